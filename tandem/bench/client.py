"""One streamed completion against an OpenAI-compatible server, timestamped chunk by chunk.

A content chunk is an SSE event whose first choice carries non-empty `text` (completions)
or `delta.content` (chat): what a user sees arrive. Usage comes from the final chunk
(`stream_options.include_usage`); a server that reports none is credited one token per
content chunk. Every failure (HTTP status, an error event, a dropped connection, the
per-request timeout, a malformed line) ends up in `RequestRecord.error`: a benchmark
measures failures, it does not stop at the first one.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from tandem.bench.metrics import RequestRecord
from tandem.bench.workload import RequestSpec

Clock = Callable[[], float]


def request_body(
    spec: RequestSpec, model: str, prompt_format: str, ignore_eos: bool
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": spec.prompt_ids if prompt_format == "tokens" else spec.prompt_text,
        "max_tokens": spec.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:  # fixed output lengths; a server that does not know the field ignores it
        body["ignore_eos"] = True
    return body


def handle_event(rec: RequestRecord, data: bytes, now: float) -> bool:
    """Apply one SSE `data:` payload to the record; True when the stream is over."""
    data = data.strip()
    if data == b"[DONE]":
        return True
    event = json.loads(data)
    if not isinstance(event, dict):
        raise ValueError("SSE event is not a JSON object")
    if "error" in event:
        err = event["error"]
        rec.error = str(err.get("message", err) if isinstance(err, dict) else err)
        return True
    choices = event.get("choices") or []
    if choices and isinstance(choices[0], dict):
        choice = choices[0]
        text = choice.get("text") or (choice.get("delta") or {}).get("content")
        if text:
            rec.chunks.append(now)
    usage = event.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        rec.output_tokens = usage["completion_tokens"]
    return False


async def send(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    rec: RequestRecord,
    timeout: float,
    clock: Clock = time.perf_counter,
) -> RequestRecord:
    """POST one streaming request and fill `rec` in; never raises (but lets cancellation)."""
    rec.sent = clock()
    try:
        async with asyncio.timeout(timeout), session.post(url, json=body) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return rec
            ended = False
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue  # blank separators, comments, other SSE fields
                if handle_event(rec, line[5:], clock()):
                    ended = True
                    break
            if rec.error is None and not ended:
                rec.error = "stream ended without [DONE]"
    except TimeoutError:
        rec.error = f"timed out after {timeout:g}s"
    except (aiohttp.ClientError, OSError, ValueError) as exc:  # ValueError: bad JSON too
        rec.error = f"{type(exc).__name__}: {exc}"
    finally:
        rec.done = clock()
    if rec.output_tokens == 0:  # no usage reported: one token per content chunk
        rec.output_tokens = len(rec.chunks)
    if rec.error is None and not rec.chunks:
        rec.error = "no content in the response"
    return rec
