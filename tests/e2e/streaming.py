"""The e2e tests' shared helpers: a streamed completion as a plain client reads it, the
decode nodes' load from the registry, and killing the node a stream runs on."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from shared.bus.client import Bus
from shared.bus.registry import NodeRegistry
from tandem.launcher import Stack

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
    async for data in stream_events(session, url, body):
        for choice in data["choices"] or [{"index": 0, "text": ""}]:
            texts.setdefault(choice["index"], []).append(choice["text"])
            if events is not None:
                events.append(choice["text"])
    return ["".join(texts[i]) for i in sorted(texts)]


async def completion_events(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> AsyncIterator[dict[str, Any]]:
    """POST a streamed completion; each event's JSON as it comes, error events too."""
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode()
            if line.startswith("data: {"):
                yield json.loads(line[6:])


async def stream_events(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> AsyncIterator[dict[str, Any]]:
    """`completion_events`, where an error event fails."""
    async for data in completion_events(session, url, body):
        assert "error" not in data, data
        yield data


async def registry(stack: Stack, since: float = 0.0) -> dict[str, tuple[int, bool]]:
    """Decode node → (running sequences, draining), from the registry; with `since` (unix
    seconds), {} unless every decode node's entry was written after it (a heartbeat from
    before may still count a stream that has ended)."""
    bus = await Bus(stack.nats_url, "e2e-registry", stack.auth).connect()
    try:
        nodes = await (await NodeRegistry(bus).start()).nodes()
    finally:
        await bus.close()
    decodes = [n for n in nodes.values() if n.role == "decode"]
    if any(n.timestamp < since for n in decodes):
        return {}
    return {n.node_id: (n.running, n.draining) for n in decodes}


async def wait_for(what: str, check: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


async def kill_its_decode_node(
    stack: Stack, events: list[str], after: int, running: int | None = None
) -> str:
    """Once `events` holds `after` events and exactly one decode node runs sequences
    (`running` of them, if given), SIGKILL that node; its id. Only entries written after
    the `after`-th event count: an older heartbeat of the node that served the stream
    before this one could still say it runs one, and the wrong node would die."""
    holder: list[str] = []
    since: list[float] = []

    async def serving() -> bool:
        if len(events) < after:
            return False
        since[:] = since or [time.time()]
        busy = {node: r for node, (r, _) in (await registry(stack, since[0])).items() if r > 0}
        holder[:] = list(busy)
        sequences = list(busy.values())
        wanted = len(busy) == 1 and (running is None or sequences == [running])
        return wanted and len(events) >= after

    await wait_for("the stream to be a few tokens in", serving)
    await asyncio.to_thread(stack.kill, holder[0])
    return holder[0]
