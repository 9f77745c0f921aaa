"""Parse and validate OpenAI-style request bodies into a prompt and sampling parameters.

Every failure raises InvalidRequestError (NotFoundError for an unknown model) with the
message and offending parameter; nothing is queued or touched before a body passes.
Unknown fields are ignored (as OpenAI does), but known fields must have the right type and
range.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from services.router.body_fields import bad, boolean, integer, number, text_field
from services.router.options import (
    cache_salt_option,
    echo_option,
    guide_option,
    logprobs_option,
    processing_options,
    prompt_logprobs_option,
    response_logprobs_bound,
)
from shared.errors import NotFoundError
from shared.model.tokenizer import TokenizerInfo
from shared.sampling_params import SamplingParams


@dataclass(frozen=True)
class Limits:
    max_tokens: int = 4096  # upper bound for one request's max_tokens
    max_prompt_tokens: int | None = None  # None: the model's context
    default_max_tokens: int = 16  # completions default, as OpenAI
    max_stop: int = 4
    max_stop_len: int = 256
    max_n: int = 16  # choices of one request (each a request inside the cluster)
    # a models file's own limits per served model: (max_tokens, max_prompt_tokens), None
    # where it keeps the server's
    per_model: Mapping[str, tuple[int | None, int | None]] = field(default_factory=dict)

    def for_model(self, model: str) -> Limits:
        """The limits a request for `model` is held to."""
        max_tokens, max_prompt = self.per_model.get(model, (None, None))
        if max_tokens is None and max_prompt is None:
            return self
        return replace(
            self,
            max_tokens=self.max_tokens if max_tokens is None else max_tokens,
            max_prompt_tokens=self.max_prompt_tokens if max_prompt is None else max_prompt,
        )


@dataclass
class ParsedRequest:
    chat: bool
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    n: int = 1  # independent samples (choices) of the prompt (services/router/choices.py)
    echo: bool = False  # completions: the prompt's text (and logprobs) before the output
    hide_output: bool = False  # `max_tokens: 0` with echo: one token made, none shown


def _stop(body: dict[str, Any], limits: Limits) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise bad("'stop' must be a non-empty string or a list of them", "stop")
    items = [text_field(s, "stop") for s in items]
    if len(items) > limits.max_stop or any(len(s) > limits.max_stop_len for s in items):
        raise bad(
            f"'stop' allows at most {limits.max_stop} strings of {limits.max_stop_len} chars",
            "stop",
        )
    return tuple(items)


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    out = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
            raise bad("each message needs a role of system, user or assistant", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text is supported
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise bad("only text content parts are supported", "messages")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise bad("message content must be a string", "messages")
        out.append({"role": m["role"], "content": text_field(content, "messages")})
    return out


def _within_length(chars: int, tok: TokenizerInfo, limits: Limits, param: str) -> None:
    """Refuse, before tokenising, text longer than any prompt the limits take can be. Text
    of c characters is at least c / `tok.max_token_chars` tokens; the factor 2 leaves room
    for a normaliser that merges characters (NFKC). With the whole context allowed this only
    refuses what the body limit already does for most models; with --max-prompt-tokens it
    spares the tokenising thread (shared by every key) a prompt bound to be refused."""
    tokens = tok.max_model_len - 1
    if limits.max_prompt_tokens is not None:
        tokens = min(tokens, limits.max_prompt_tokens)
    most = 2 * tokens * tok.max_token_chars
    if chars > most:
        raise bad(
            f"prompt of {chars} characters: longer than a prompt of at most {tokens} tokens "
            f"can be (at most {most} characters with this tokenizer); refused before "
            "tokenising",
            param,
        )


def _prompt(body: dict[str, Any], tok: TokenizerInfo, limits: Limits) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad("'prompt' must not be empty", "prompt")
        _within_length(len(prompt), tok, limits, "prompt")
        return tok.encode(text_field(prompt, "prompt"))
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        if not prompt:
            raise bad("'prompt' must not be empty", "prompt")
        if not all(0 <= t < tok.vocab_size for t in prompt):
            raise bad(f"'prompt' token ids must be in [0, {tok.vocab_size})", "prompt")
        return list(prompt)
    raise bad("'prompt' must be a string or a list of token ids (one prompt)", "prompt")


def _model(body: dict[str, Any], served: Mapping[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str):
        raise bad("'model' is required and must be a string", "model")
    if model not in served:
        raise NotFoundError(f"model '{model}' not found", param="model", code="model_not_found")
    return model


def _prompt_ids(body: dict[str, Any], chat: bool, tok: TokenizerInfo, limits: Limits) -> list[int]:
    """The prompt as token ids (a chat's messages through the chat template), within limits."""
    if chat:
        messages = _messages(body)
        _within_length(sum(len(m["content"]) for m in messages), tok, limits, "messages")
        prompt_ids = tok.chat(messages)
    else:
        prompt_ids = _prompt(body, tok, limits)
    if not prompt_ids:
        raise bad("the prompt is empty after tokenisation", "prompt")
    param = "messages" if chat else "prompt"
    if len(prompt_ids) >= tok.max_model_len:
        raise bad(
            f"prompt has {len(prompt_ids)} tokens; the model's context is {tok.max_model_len}",
            param,
        )
    if limits.max_prompt_tokens is not None and len(prompt_ids) > limits.max_prompt_tokens:
        raise bad(
            f"prompt has {len(prompt_ids)} tokens; this server accepts at most "
            f"{limits.max_prompt_tokens}",
            param,
        )
    return prompt_ids


def _max_tokens(
    body: dict[str, Any],
    chat: bool,
    echo: bool,
    prompt_tokens: int,
    tok: TokenizerInfo,
    limits: Limits,
) -> int:
    """Tokens to generate at most: as asked, within limits and the model's context (a chat
    that asks nothing gets the room left, a completion OpenAI's default; an echo may ask 0,
    which `parse_request` serves as 1 token made and hidden)."""
    # OpenAI's newer name, taken on both endpoints (vLLM does too)
    key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = integer(body, key, None if chat else limits.default_max_tokens)
    room = tok.max_model_len - prompt_tokens
    if max_tokens is None:
        max_tokens = min(room, limits.max_tokens)
    if max_tokens == 0 and echo:
        return 0
    if max_tokens <= 0 or max_tokens > limits.max_tokens:
        raise bad(f"'{key}' must be between 1 and {limits.max_tokens}", key)
    if max_tokens > room:
        raise bad(
            f"prompt ({prompt_tokens} tokens) plus {key} ({max_tokens}) exceeds the "
            f"model's context of {tok.max_model_len}",
            key,
        )
    return max_tokens


def _sampling(
    body: dict[str, Any],
    chat: bool,
    echo: bool,
    max_tokens: int,
    prompt_tokens: int,
    limits: Limits,
    vocab: int,
) -> SamplingParams:
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=number(body, "temperature", 1.0),
        top_p=number(body, "top_p", 1.0),
        top_k=integer(body, "top_k", 0) or 0,
        seed=integer(body, "seed", None),
        stop=_stop(body, limits),
        ignore_eos=boolean(body, "ignore_eos", False),
        cache_salt=cache_salt_option(body),
        guide=guide_option(body),
        logprobs=(k := logprobs_option(body, chat)),
        prompt_logprobs=prompt_logprobs_option(echo, prompt_tokens, k),
        **processing_options(body, vocab),
    )
    params.validate()  # the ranges, written once: every node checks the same
    return params


def _include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    return bool(options and options.get("include_usage") is True)


def tokenize_body(body: dict[str, Any], tok: TokenizerInfo) -> list[int]:
    """The tokens of a `/tokenize` body: a chat's `messages` through the chat template (with
    `add_generation_prompt`, default true) or a `prompt` string (with `add_special_tokens`,
    default true), as vLLM's endpoint takes them."""
    if "messages" in body:
        return tok.chat(_messages(body), boolean(body, "add_generation_prompt", True))
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise bad("'prompt' must be a string (or send 'messages')", "prompt")
    return tok.encode(
        text_field(prompt, "prompt"), add_special_tokens=boolean(body, "add_special_tokens", True)
    )


def parse_request(
    body: Any, chat: bool, tokenizers: Mapping[str, TokenizerInfo], limits: Limits
) -> ParsedRequest:
    """The body of a completion or chat request, checked and tokenised by the tokenizer of
    the model it names (`tokenizers`: the served models'; another is a 404)."""
    if not isinstance(body, dict):
        raise bad("request body must be a JSON object")
    model = _model(body, tokenizers)
    tok = tokenizers[model]
    limits = limits.for_model(model)
    n = integer(body, "n", 1)
    if n is None:  # null: the default
        n = 1
    if not 1 <= n <= limits.max_n:
        raise bad(f"'n' must be between 1 and {limits.max_n}", "n")
    echo = echo_option(body, chat)
    prompt_ids = _prompt_ids(body, chat, tok, limits)
    max_tokens = _max_tokens(body, chat, echo, len(prompt_ids), tok, limits)
    hide_output = max_tokens == 0  # an echo alone: a token is made (the engine makes at
    max_tokens = max_tokens or 1  # least one) and not shown
    params = _sampling(body, chat, echo, max_tokens, len(prompt_ids), limits, tok.vocab_size)
    stream = boolean(body, "stream", False)
    response_logprobs_bound(n, max_tokens, params.logprobs, stream)
    return ParsedRequest(
        chat,
        model,
        prompt_ids,
        params,
        stream,
        _include_usage(body),
        echo=echo,
        n=n,
        hide_output=hide_output,
    )
