"""OpenAI response bodies: streamed chunks and whole completions, for chat and text."""

from __future__ import annotations

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
) -> dict[str, Any]:
    """One server-sent event's body; a chat stream's first chunk carries the role, and
    `logprobs` (services/router/logprobs.py) the event's tokens' when the request asked."""
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
                {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            ],
        }
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": parsed.model,
        "choices": [{"index": 0, "text": text, "finish_reason": reason, "logprobs": logprobs}],
    }


def completion(
    parsed: ParsedRequest,
    rid: str,
    created: int,
    text: str,
    reason: str | None,
    usage: dict[str, int],
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The body of a non-streamed response."""
    if parsed.chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": logprobs,
            "finish_reason": reason,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": logprobs}
        obj = "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": parsed.model,
        "choices": [choice],
        "usage": usage,
    }
