"""Parse and validate OpenAI-style request bodies into a prompt and sampling parameters.

Every failure raises InvalidRequestError (NotFoundError for an unknown model) with the
message and offending parameter; nothing is queued or touched before a body passes.
Unknown fields are ignored (as OpenAI does), but known fields must have the right type and
range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from shared.bus.params import SamplingParams
from shared.errors import InvalidRequestError, NotFoundError
from shared.model.tokenizer import TokenizerInfo


@dataclass(frozen=True)
class Limits:
    max_tokens: int = 4096  # upper bound for one request's max_tokens
    max_prompt_tokens: int | None = None  # None: the model's context
    default_max_tokens: int = 16  # completions default, as OpenAI
    max_stop: int = 4
    max_stop_len: int = 256


@dataclass
class ParsedRequest:
    chat: bool
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool


def _bad(message: str, param: str | None = None) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def _int(body: dict[str, Any], key: str, default: int | None) -> int | None:
    value = body.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"'{key}' must be an integer", key)
    if not -(2**63) <= value < 2**63:  # JSON allows any length; nothing here takes more
        raise _bad(f"'{key}' must fit in a signed 64-bit integer", key)
    return value


def _text(value: str, param: str) -> str:
    """`value` if it is valid Unicode text: JSON escapes can make lone surrogates
    ("\\ud800"), which no tokenizer can encode."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _bad(f"'{param}' holds an invalid character (a lone surrogate)", param) from exc
    return value


def _number(body: dict[str, Any], key: str, default: float) -> float:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(f"'{key}' must be a number", key)
    return float(value)


def _bool(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(f"'{key}' must be a boolean", key)
    return value


def _stop(body: dict[str, Any], limits: Limits) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise _bad("'stop' must be a non-empty string or a list of them", "stop")
    items = [_text(s, "stop") for s in items]
    if len(items) > limits.max_stop or any(len(s) > limits.max_stop_len for s in items):
        raise _bad(
            f"'stop' allows at most {limits.max_stop} strings of {limits.max_stop_len} chars",
            "stop",
        )
    return tuple(items)


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list", "messages")
    out = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
            raise _bad("each message needs a role of system, user or assistant", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text is supported
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise _bad("only text content parts are supported", "messages")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise _bad("message content must be a string", "messages")
        out.append({"role": m["role"], "content": _text(content, "messages")})
    return out


def _prompt(body: dict[str, Any], tok: TokenizerInfo) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise _bad("'prompt' must not be empty", "prompt")
        return tok.encode(_text(prompt, "prompt"))
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        if not prompt:
            raise _bad("'prompt' must not be empty", "prompt")
        if not all(0 <= t < tok.vocab_size for t in prompt):
            raise _bad(f"'prompt' token ids must be in [0, {tok.vocab_size})", "prompt")
        return list(prompt)
    raise _bad("'prompt' must be a string or a list of token ids (one prompt)", "prompt")


def _model(body: dict[str, Any], served: set[str]) -> str:
    model = body.get("model")
    if not isinstance(model, str):
        raise _bad("'model' is required and must be a string", "model")
    if model not in served:
        raise NotFoundError(f"model '{model}' not found", param="model", code="model_not_found")
    return model


def _prompt_ids(body: dict[str, Any], chat: bool, tok: TokenizerInfo, limits: Limits) -> list[int]:
    """The prompt as token ids (a chat's messages through the chat template), within limits."""
    prompt_ids = tok.chat(_messages(body)) if chat else _prompt(body, tok)
    if not prompt_ids:
        raise _bad("the prompt is empty after tokenisation", "prompt")
    param = "messages" if chat else "prompt"
    if len(prompt_ids) >= tok.max_model_len:
        raise _bad(
            f"prompt has {len(prompt_ids)} tokens; the model's context is {tok.max_model_len}",
            param,
        )
    if limits.max_prompt_tokens is not None and len(prompt_ids) > limits.max_prompt_tokens:
        raise _bad(
            f"prompt has {len(prompt_ids)} tokens; this server accepts at most "
            f"{limits.max_prompt_tokens}",
            param,
        )
    return prompt_ids


def _max_tokens(
    body: dict[str, Any], chat: bool, prompt_tokens: int, tok: TokenizerInfo, limits: Limits
) -> int:
    """Tokens to generate at most: as asked, within limits and the model's context (a chat
    that asks nothing gets the room left, a completion OpenAI's default)."""
    # OpenAI's newer name, taken on both endpoints (vLLM does too)
    key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = _int(body, key, None if chat else limits.default_max_tokens)
    room = tok.max_model_len - prompt_tokens
    if max_tokens is None:
        max_tokens = min(room, limits.max_tokens)
    if max_tokens <= 0 or max_tokens > limits.max_tokens:
        raise _bad(f"'{key}' must be between 1 and {limits.max_tokens}", key)
    if max_tokens > room:
        raise _bad(
            f"prompt ({prompt_tokens} tokens) plus {key} ({max_tokens}) exceeds the "
            f"model's context of {tok.max_model_len}",
            key,
        )
    return max_tokens


MAX_BIASED_TOKENS = 1024
MAX_STOP_TOKEN_IDS = 64
MAX_USER_LEN = 256


def _token_ids(value: Any, param: str, vocab: int, limit: int) -> list[int]:
    if not isinstance(value, list) or len(value) > limit:
        raise _bad(f"'{param}' must be a list of at most {limit} token ids", param)
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in value):
        raise _bad(f"'{param}' must hold token ids in [0, {vocab})", param)
    return value


def _logit_bias(body: dict[str, Any], vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's `{"<token id>": bias}`; ids as strings (JSON keys) or ints."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict) or len(value) > MAX_BIASED_TOKENS:
        raise _bad(
            f"'logit_bias' must map at most {MAX_BIASED_TOKENS} token ids to biases", "logit_bias"
        )
    out = []
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError) as exc:
            raise _bad("'logit_bias' keys must be token ids", "logit_bias") from exc
        if not 0 <= token < vocab:
            raise _bad(f"'logit_bias' token ids must be in [0, {vocab})", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise _bad("'logit_bias' values must be numbers", "logit_bias")
        out.append((token, float(bias)))
    return tuple(sorted(out))


def _processing(body: dict[str, Any], vocab: int) -> dict[str, Any]:
    """Penalties, logit bias, min_tokens and stop_token_ids (ranges checked by
    SamplingParams.validate); `user` is checked and otherwise ignored."""
    user = body.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > MAX_USER_LEN):
        raise _bad(f"'user' must be a string of at most {MAX_USER_LEN} characters", "user")
    stop_ids = body.get("stop_token_ids")
    return {
        "presence_penalty": _number(body, "presence_penalty", 0.0),
        "frequency_penalty": _number(body, "frequency_penalty", 0.0),
        "repetition_penalty": _number(body, "repetition_penalty", 1.0),
        "logit_bias": _logit_bias(body, vocab),
        "min_tokens": _int(body, "min_tokens", 0) or 0,
        "stop_token_ids": tuple(
            _token_ids(stop_ids, "stop_token_ids", vocab, MAX_STOP_TOKEN_IDS)
            if stop_ids is not None
            else ()
        ),
    }


def _sampling(body: dict[str, Any], max_tokens: int, limits: Limits, vocab: int) -> SamplingParams:
    temperature = _number(body, "temperature", 1.0)
    if not 0 <= temperature <= 2:
        raise _bad("'temperature' must be between 0 and 2", "temperature")
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise _bad("'top_p' must be in (0, 1]", "top_p")
    top_k = _int(body, "top_k", 0) or 0
    if top_k < -1:
        raise _bad("'top_k' must be -1, 0 or positive", "top_k")
    seed = _int(body, "seed", None)
    if seed is not None and not 0 <= seed < 2**63:
        raise _bad("'seed' must be a non-negative 63-bit integer", "seed")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop=_stop(body, limits),
        ignore_eos=_bool(body, "ignore_eos", False),
        cache_salt=_cache_salt(body),
        **_processing(body, vocab),
    )
    params.validate()  # the ranges every node checks too
    return params


MAX_CLIENT_SALT = 256


def _cache_salt(body: dict[str, Any]) -> str:
    """vLLM's `cache_salt`: requests share cached prefixes only with the same salt."""
    value = body.get("cache_salt")
    if value is None:
        return ""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_CLIENT_SALT:
        raise _bad(
            f"'cache_salt' must be a string of 1 to {MAX_CLIENT_SALT} characters", "cache_salt"
        )
    return _text(value, "cache_salt")


def _include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("'stream_options' must be an object", "stream_options")
    return bool(options and options.get("include_usage") is True)


def tokenize_body(body: dict[str, Any], tok: TokenizerInfo) -> list[int]:
    """The tokens of a `/tokenize` body: a chat's `messages` through the chat template (with
    `add_generation_prompt`, default true) or a `prompt` string (with `add_special_tokens`,
    default true), as vLLM's endpoint takes them."""
    if "messages" in body:
        return tok.chat(_messages(body), _bool(body, "add_generation_prompt", True))
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise _bad("'prompt' must be a string (or send 'messages')", "prompt")
    return tok.encode(
        _text(prompt, "prompt"), add_special_tokens=_bool(body, "add_special_tokens", True)
    )


def _refuse_unsupported(body: dict[str, Any]) -> None:
    """Parameters a client relies on that Tandem does not implement yet: a clear 400, not
    a response that silently lacks what was asked for."""
    for key in ("logprobs", "top_logprobs", "echo"):
        if body.get(key) not in (None, False, 0):
            raise _bad(f"'{key}' is not supported yet", key)
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise _bad("'response_format' other than text is not supported yet", "response_format")


def parse_request(
    body: Any, chat: bool, tok: TokenizerInfo, served: set[str], limits: Limits
) -> ParsedRequest:
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object")
    model = _model(body, served)
    if _int(body, "n", 1) != 1:
        raise _bad("only n=1 is supported", "n")
    _refuse_unsupported(body)
    prompt_ids = _prompt_ids(body, chat, tok, limits)
    max_tokens = _max_tokens(body, chat, len(prompt_ids), tok, limits)
    params = _sampling(body, max_tokens, limits, tok.vocab_size)
    stream = _bool(body, "stream", False)
    return ParsedRequest(chat, model, prompt_ids, params, stream, _include_usage(body))
