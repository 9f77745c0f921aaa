"""OpenAI response bodies: streamed chunks and whole completions, for chat and text."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.router.validation import ParsedRequest


def chunk(
    parsed: ParsedRequest,
    rid: str,
    created: int,
    text: str,
    reason: str | None,
    first: bool,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    """One server-sent event's body, of choice `index`; a chat stream's first chunk carries
    the role, and `logprobs` (services/router/logprobs.py) the event's tokens' when the
    request asked."""
    if parsed.chat:
        delta: dict[str, Any] = {"content": text} if text or not first else {}
        if first:
            delta = {"role": "assistant", "content": text}
        return {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": parsed.model,
            "choices": [
                {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            ],
        }
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": parsed.model,
        "choices": [{"index": index, "text": text, "finish_reason": reason, "logprobs": logprobs}],
    }


@dataclass
class Output:
    """One choice's whole output."""

    text: str
    reason: str | None
    logprobs: dict[str, Any] | None = None


def completion(
    parsed: ParsedRequest,
    rid: str,
    created: int,
    outputs: list[Output],
    usage: dict[str, int],
) -> dict[str, Any]:
    """The body of a non-streamed response: a choice per output (`n`), in order."""
    choices: list[dict[str, Any]] = []
    for i, out in enumerate(outputs):
        if parsed.chat:
            choices.append(
                {
                    "index": i,
                    "message": {"role": "assistant", "content": out.text},
                    "logprobs": out.logprobs,
                    "finish_reason": out.reason,
                }
            )
        else:
            choices.append(
                {
                    "index": i,
                    "text": out.text,
                    "finish_reason": out.reason,
                    "logprobs": out.logprobs,
                }
            )
    return {
        "id": rid,
        "object": "chat.completion" if parsed.chat else "text_completion",
        "created": created,
        "model": parsed.model,
        "choices": choices,
        "usage": usage,
    }
