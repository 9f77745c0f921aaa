"""A streamed completion as a plain client reads it (the e2e tests' shared helper)."""

from __future__ import annotations

import json
from typing import Any

import aiohttp

MODEL = "smollm2-135m-instruct"


async def complete(
    session: aiohttp.ClientSession,
    url: str,
    ids: list[int],
    n: int,
    extra: dict[str, Any] | None = None,
    events: list[str] | None = None,
) -> str:
    """Stream a greedy completion of `n` tokens (plus `extra` body fields); its text. Each
    event's text is also appended to `events` as it arrives, if given."""
    return (await complete_choices(session, url, ids, n, extra, events))[0]


async def complete_choices(
    session: aiohttp.ClientSession,
    url: str,
    ids: list[int],
    n: int,
    extra: dict[str, Any] | None = None,
    events: list[str] | None = None,
) -> list[str]:
    """`complete`, for a body that may ask for several choices (`n` in `extra`): each
    choice's text, by index."""
    body = {"model": MODEL, "prompt": ids, "max_tokens": n, "temperature": 0, "stream": True}
    body.update(extra or {})
    texts: dict[int, list[str]] = {}
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode()
            if line.startswith("data: {"):
                data = json.loads(line[6:])
                assert "error" not in data, data
                for choice in data["choices"] or [{"index": 0, "text": ""}]:
                    texts.setdefault(choice["index"], []).append(choice["text"])
                    if events is not None:
                        events.append(choice["text"])
    return ["".join(texts[i]) for i in sorted(texts)]
