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
    body = {"model": MODEL, "prompt": ids, "max_tokens": n, "temperature": 0, "stream": True}
    body.update(extra or {})
    text = []
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode()
            if line.startswith("data: {"):
                data = json.loads(line[6:])
                assert "error" not in data, data
                text.append(data["choices"][0]["text"] if data["choices"] else "")
                if events is not None:
                    events.append(text[-1])
    return "".join(text)
