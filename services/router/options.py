"""The OpenAI (and vLLM) options beyond plain sampling: penalties, logit bias, minimum
length, stop token ids, `user`, logprobs, echo and `cache_salt`, read from a request body
(ranges that every node checks again are in `SamplingParams.validate`)."""

from __future__ import annotations

from typing import Any

from services.router.body_fields import bad, boolean, integer, number, text_field
from shared.grammar import grammar_for
from shared.sampling_params import MAX_LOGPROBS

MAX_BIASED_TOKENS = 1024
MAX_STOP_TOKEN_IDS = 64
MAX_USER_LEN = 256
MAX_CLIENT_SALT = 256

# A first token delta carries the prompt's logprobs, each ~20 bytes + 12 per alternative
# on the wire; one message stays well under NATS' limit (MAX_MESSAGE_BYTES).
MAX_PROMPT_LOGPROB_BYTES = 384 * 1024
# A response that is not streamed keeps every token's logprobs in the router until its last
# token, then goes out as one JSON body: n x max_tokens x (1 + alternatives) entries of ~70
# bytes of JSON and several hundred of Python objects each (at n=16, 4,096 tokens and 20
# alternatives, ~1.4 million: about half a GB and seconds of serialising). A streamed one
# sends each token's entries with it and keeps none, so only the others are bounded.
MAX_RESPONSE_LOGPROB_ENTRIES = 1 << 18  # ~18 MB of JSON


def _token_ids(value: Any, param: str, vocab: int, limit: int) -> list[int]:
    if not isinstance(value, list) or len(value) > limit:
        raise bad(f"'{param}' must be a list of at most {limit} token ids", param)
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in value):
        raise bad(f"'{param}' must hold token ids in [0, {vocab})", param)
    return value


def _logit_bias(body: dict[str, Any], vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's `{"<token id>": bias}`; ids as strings (JSON keys) or ints."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict) or len(value) > MAX_BIASED_TOKENS:
        raise bad(
            f"'logit_bias' must map at most {MAX_BIASED_TOKENS} token ids to biases", "logit_bias"
        )
    out = []
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError) as exc:
            raise bad("'logit_bias' keys must be token ids", "logit_bias") from exc
        if not 0 <= token < vocab:
            raise bad(f"'logit_bias' token ids must be in [0, {vocab})", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise bad("'logit_bias' values must be numbers", "logit_bias")
        out.append((token, float(bias)))
    return tuple(sorted(out))


def processing_options(body: dict[str, Any], vocab: int) -> dict[str, Any]:
    """Penalties, logit bias, min_tokens and stop_token_ids (ranges checked by
    SamplingParams.validate); `user` is checked and otherwise ignored."""
    user = body.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > MAX_USER_LEN):
        raise bad(f"'user' must be a string of at most {MAX_USER_LEN} characters", "user")
    stop_ids = body.get("stop_token_ids")
    return {
        "presence_penalty": number(body, "presence_penalty", 0.0),
        "frequency_penalty": number(body, "frequency_penalty", 0.0),
        "repetition_penalty": number(body, "repetition_penalty", 1.0),
        "logit_bias": _logit_bias(body, vocab),
        "min_tokens": integer(body, "min_tokens", 0) or 0,
        "stop_token_ids": tuple(
            _token_ids(stop_ids, "stop_token_ids", vocab, MAX_STOP_TOKEN_IDS)
            if stop_ids is not None
            else ()
        ),
    }


def logprobs_option(body: dict[str, Any], chat: bool) -> int | None:
    """How many top alternatives each token's logprob comes with (None: no logprobs). A
    completion asks with `logprobs: k`; a chat with `logprobs: true` and `top_logprobs: k`."""
    if not chat:
        k = integer(body, "logprobs", None)
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            raise bad(f"'logprobs' must be between 0 and {MAX_LOGPROBS}", "logprobs")
        return k
    top = integer(body, "top_logprobs", None)
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise bad(f"'top_logprobs' must be between 0 and {MAX_LOGPROBS}", "top_logprobs")
    if not boolean(body, "logprobs", False):
        if top:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return None
    return top or 0


def response_logprobs_bound(n: int, max_tokens: int, k: int | None, stream: bool) -> None:
    """Refuse a response that is not streamed whose logprobs would pass the bound above."""
    if k is None or stream:
        return
    entries = n * max_tokens * (1 + k)
    if entries > MAX_RESPONSE_LOGPROB_ENTRIES:
        raise bad(
            f"a response that is not streamed carries at most {MAX_RESPONSE_LOGPROB_ENTRIES} "
            f"logprob entries (n x max_tokens x (1 + alternatives)); this request asks for "
            f'{entries}: stream it ("stream": true), or ask fewer tokens, choices or '
            "alternatives",
            "logprobs",
        )


def echo_option(body: dict[str, Any], chat: bool) -> bool:
    if chat:
        if body.get("echo") not in (None, False):
            raise bad("'echo' is for completions; chat does not support it", "echo")
        return False
    return boolean(body, "echo", False)


def prompt_logprobs_option(echo: bool, prompt_tokens: int, k: int | None) -> int | None:
    """`echo` with `logprobs: k`: the prompt's tokens' logprobs too (None: not asked)."""
    if k is None or not echo:
        return None
    if prompt_tokens * (20 + 12 * k) > MAX_PROMPT_LOGPROB_BYTES:
        raise bad(
            f"echo with logprobs {k} covers at most "
            f"{MAX_PROMPT_LOGPROB_BYTES // (20 + 12 * k)} prompt tokens; this prompt has "
            f"{prompt_tokens} (ask fewer alternatives or send a shorter prompt)",
            "logprobs",
        )
    return k


def guide_option(body: dict[str, Any]) -> str:
    """`response_format` as the llguidance grammar the output must follow ("" for text)."""
    value = body.get("response_format")
    if value is None:
        return ""
    if not isinstance(value, dict):
        raise bad("'response_format' must be an object with a 'type'", "response_format")
    return grammar_for(value)


def cache_salt_option(body: dict[str, Any]) -> str:
    """vLLM's `cache_salt`: requests share cached prefixes only with the same salt."""
    value = body.get("cache_salt")
    if value is None:
        return ""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_CLIENT_SALT:
        raise bad(
            f"'cache_salt' must be a string of 1 to {MAX_CLIENT_SALT} characters", "cache_salt"
        )
    return text_field(value, "cache_salt")
