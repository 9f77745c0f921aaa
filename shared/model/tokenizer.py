"""The tokenizer side of a model, without its weights and without torch: what the router needs.

It reads the converted model directory's `tokenizer.json` with the `tokenizers` library and
renders its chat template with jinja2 the way `transformers`' `apply_chat_template` does
(a sandboxed environment with `trim_blocks`/`lstrip_blocks`, loop controls, a `tojson`
that does not escape HTML, `raise_exception`, `strftime_now`, the special tokens as
variables). `transformers.AutoTokenizer` would do the same but imports torch, which an
HTTP router has no use for (~300 MB of RSS). tests/unit/test_tokenizer.py holds both to
the same token ids.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from shared.errors import InvalidRequestError, ModelLoadError
from shared.model.convert import converted_dir
from shared.model.source import resolve_model

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant text for training masks):
    rendered as its body, as transformers does when it does not track those spans."""

    tags = {"generation"}  # noqa: RUF012 - jinja2 reads it as a class attribute

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: Any = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


@dataclass
class TokenizerInfo:
    served_name: str
    tokenizer: Tokenizer
    max_model_len: int
    chat_template: jinja2.Template | None = None
    special_tokens: dict[str, str] | None = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # encode_batch releases the GIL while it works; encode holds it (a 1 MB prompt
        # stalled the router's event loop for a second even from another thread)
        (encoding,) = self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(encoding.ids)

    def decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=False))

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token's text can span: its longest vocabulary entry (for
        byte-level BPE an entry has a character per byte, never fewer than the text's; a
        byte-fallback entry like <0xE2> is longer than its byte). So text of c characters
        is at least c / max_token_chars tokens (the router refuses by length on that)."""
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        return max((len(entry) for entry in vocab), default=1)

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        if self.chat_template is None:  # the request's fault as the client sees it
            raise InvalidRequestError("this model has no chat template", param="messages")
        try:
            text = self.chat_template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                **(self.special_tokens or {}),
            )
        except Exception as exc:  # jinja raises several types for bad input
            raise InvalidRequestError(
                f"the chat template refused these messages: {str(exc)[:200]}", param="messages"
            ) from exc
        return self.encode(str(text))


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    out = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        if isinstance(value, dict):  # {"content": "<s>", ...} in older configs
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


def _chat_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    path = model_dir / "chat_template.jinja"
    if path.is_file():
        return path.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


def load_tokenizer(name: str | None) -> TokenizerInfo:
    source = resolve_model(name)
    model_dir = converted_dir(source)
    try:
        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        with open(model_dir / "config.json") as f:
            max_len = int(json.load(f).get("max_position_embeddings", 2048))
        template = _chat_template(model_dir, config)
        compiled = _compile(template) if template is not None else None
    except Exception as exc:  # any unreadable tokenizer is a model error
        raise ModelLoadError(f"cannot load tokenizer from {model_dir}: {exc}") from exc
    return TokenizerInfo(source.served_name, tokenizer, max_len, compiled, _special_tokens(config))
