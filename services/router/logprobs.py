"""Token logprobs in OpenAI's response shapes, from the nodes' `TokenLogprob`s.

A completion's `logprobs` is the legacy object of parallel lists (`tokens`,
`token_logprobs`, `top_logprobs` as {token: logprob} including the sampled token, and
`text_offset` into the response's text); with `echo` the prompt's tokens come first, the
very first with no logprob (nothing predicts it). A chat's is `{"content": [...]}`, one
entry per token with its `bytes` and its `top_logprobs` list. A streamed response carries
each event's tokens' part; a whole response all of them. Token texts come from the
router's tokenizer, one token at a time (as vLLM shows them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shared.bus.messages import TokenLogprob

LEGACY_KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


@dataclass
class LogprobsWriter:
    chat: bool
    text_of: Callable[[int], str]  # one token's text
    offset: int = 0  # characters of the response before the next token (text_offset)
    content: list[dict[str, Any]] = field(default_factory=list)  # every token's, in order
    legacy: dict[str, list[Any]] = field(default_factory=lambda: {k: [] for k in LEGACY_KEYS})

    def add(self, token_ids: list[int], logprobs: list[TokenLogprob] | None) -> dict[str, Any]:
        """The part for these generated tokens (kept for `whole` too). A delta without
        them (a node that did not compute them) gives None for each."""
        lps: list[TokenLogprob | None] = [None] * len(token_ids)
        if logprobs is not None and len(logprobs) == len(token_ids):
            lps = list(logprobs)
        if self.chat:
            entries = [self._chat_entry(t, lp) for t, lp in zip(token_ids, lps, strict=True)]
            self.content.extend(entries)
            return {"content": entries}
        return self._legacy_part(token_ids, lps)

    def add_prompt(
        self, prompt_ids: list[int], logprobs: list[TokenLogprob] | None
    ) -> dict[str, list[Any]]:
        """An echo's part: the prompt's tokens (logprobs for all but the first)."""
        lps: list[TokenLogprob | None] = [None] * len(prompt_ids)
        if logprobs is not None and len(logprobs) == len(prompt_ids) - 1:
            lps[1:] = logprobs
        return self._legacy_part(prompt_ids, lps)

    def whole(self) -> dict[str, Any]:
        return {"content": self.content} if self.chat else self.legacy

    def _legacy_part(
        self, token_ids: list[int], lps: list[TokenLogprob | None]
    ) -> dict[str, list[Any]]:
        part: dict[str, list[Any]] = {k: [] for k in LEGACY_KEYS}
        for token, lp in zip(token_ids, lps, strict=True):
            text = self.text_of(token)
            top = None
            if lp is not None:
                top = {self.text_of(t): v for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True)}
                top.setdefault(text, lp.logprob)
            part["tokens"].append(text)
            part["token_logprobs"].append(lp.logprob if lp is not None else None)
            part["top_logprobs"].append(top)
            part["text_offset"].append(self.offset)
            self.offset += len(text)
        for key, values in part.items():
            self.legacy[key].extend(values)
        return part

    def _chat_entry(self, token: int, lp: TokenLogprob | None) -> dict[str, Any]:
        if lp is None:
            return {**self._one(token, None), "top_logprobs": []}
        top = [self._one(t, v) for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True)]
        return {**self._one(token, lp.logprob), "top_logprobs": top}

    def _one(self, token: int, logprob: float | None) -> dict[str, Any]:
        text = self.text_of(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def merge(first: dict[str, list[Any]], then: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """Two legacy parts as one (an echo's prompt part, then its first token's)."""
    return {k: first[k] + then[k] for k in LEGACY_KEYS}
