"""The router SIGKILLed mid-stream: its clients resume by request id, the rest are cleaned up.

Stream A and stream B run; the router dies; it is restarted (same id, same port). A's client
reconnects with `Last-Event-ID` and gets the rest: its text equals an uninterrupted run's.
B's client never comes back: within the resume lease B is cancelled on every node, its
blocks freed and its journal entry gone.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from shared.bus.client import Bus
from shared.bus.journal import RequestJournal
from tandem.launcher import Stack
from tests.e2e.conftest import wait_ready
from tests.e2e.test_api import MODEL, decode_nodes
from tests.e2e.test_failover import router_metric

pytestmark = pytest.mark.e2e

RESUMABLE = {"X-Tandem-Resumable": "true"}  # events carry `id:` lines only when asked
BODY = {"model": MODEL, "max_tokens": 48, "temperature": 0, "stream": True, "ignore_eos": True}
PROMPT_A = "Tell me about the history of bridges."
PROMPT_B = "Write a poem about the sea."


async def events(resp: aiohttp.ClientResponse) -> AsyncIterator[tuple[int | None, Any]]:
    """(event id, parsed data) per server-sent event; data "[DONE]" ends the stream."""
    event_id: int | None = None
    async for raw in resp.content:
        line = raw.decode().rstrip("\n")
        if line.startswith("id: "):
            event_id = int(line[4:])
        elif line.startswith("data: "):
            data = line[6:]
            yield event_id, (data if data == "[DONE]" else json.loads(data))
            event_id = None


def text(data: Any) -> str:
    return str(data["choices"][0]["text"]) if data.get("choices") else ""


async def whole(session: aiohttp.ClientSession, url: str, prompt: str) -> str:
    async with session.post(url + "/v1/completions", json=BODY | {"prompt": prompt}) as resp:
        return "".join([text(d) async for _, d in events(resp) if d != "[DONE]"])


async def journal_has(stack: Stack, rid: str) -> bool:
    bus = await Bus(stack.nats_url, "e2e-journal", stack.auth).connect()
    try:
        return await (await RequestJournal(bus).start()).get(rid) is not None
    finally:
        await bus.close()


async def wait_idle(stack: Stack, deadline: float) -> None:
    """Until no decode node runs a sequence or holds a block for one."""
    while True:
        nodes = await decode_nodes(stack)
        if all(r == 0 and free == total for r, free, total in nodes.values()):
            return
        assert time.monotonic() < deadline, f"blocks still held: {nodes}"
        await asyncio.sleep(0.5)


async def test_router_killed_clients_resume_and_the_rest_is_cancelled(stack: Stack) -> None:
    url = stack.url
    async with aiohttp.ClientSession() as s:
        reference = await whole(s, url, PROMPT_A)
    await wait_idle(stack, time.monotonic() + 10)  # heartbeats lag a step or two

    got_a: list[str] = []
    last_a = -1
    ids: dict[str, str] = {}
    async with aiohttp.ClientSession() as s:
        resp_a = await s.post(
            url + "/v1/completions", json=BODY | {"prompt": PROMPT_A}, headers=RESUMABLE
        )
        # B runs long: only a cancel frees its blocks within the test
        long_b = BODY | {"prompt": PROMPT_B, "max_tokens": 1000}
        resp_b = await s.post(url + "/v1/completions", json=long_b, headers=RESUMABLE)
        async for _, data in events(resp_b):
            ids["b"] = data["id"]
            break
        async for event_id, data in events(resp_a):
            ids["a"] = data["id"]
            got_a.append(text(data))
            assert event_id is not None and event_id > last_a  # ids: increasing seqs
            last_a = event_id
            if event_id >= 10:
                break
        await asyncio.to_thread(stack.kill, "router")
    assert await journal_has(stack, ids["b"])  # what a new router resumes from

    stack.restart("router")
    await asyncio.to_thread(wait_ready, stack)
    async with aiohttp.ClientSession() as s:
        resume = f"{url}/v1/requests/{ids['a']}/stream"
        async with s.get(resume, headers={"Last-Event-ID": str(last_a)}) as resp:
            assert resp.status == 200, await resp.text()
            rest = []
            async for event_id, data in events(resp):
                if data == "[DONE]":
                    break
                assert data["id"] == ids["a"]
                assert event_id is not None and event_id > last_a
                rest.append(text(data))
        assert "".join(got_a) + "".join(rest) == reference  # no gap, no repeat
        assert router_metric(stack, "tandem_stream_resumes_total") == 1
        async with s.get(resume) as resp:  # finished: nothing left to resume
            assert resp.status == 404

        # B: nobody resumes it. Within the lease (5 s from the router's return) it is
        # cancelled on every node, its blocks freed, its journal entry deleted.
        deadline = time.monotonic() + 20
        while await journal_has(stack, ids["b"]):
            assert time.monotonic() < deadline, "B's journal entry outlived the lease"
            await asyncio.sleep(0.5)
        assert router_metric(stack, "tandem_requests_expired_total") >= 1
        await wait_idle(stack, deadline)
        async with s.get(f"{url}/v1/requests/{ids['b']}/stream") as resp:
            assert resp.status == 404
            assert "lease" in (await resp.json())["error"]["message"]


async def test_resume_refuses_what_it_cannot_resume(stack: Stack) -> None:
    url = stack.url
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/v1/requests/cmpl-{'0' * 24}/stream") as resp:
            assert resp.status == 404
        async with s.get(f"{url}/v1/requests/not-an-id/stream") as resp:
            assert resp.status == 404
        live = await s.post(url + "/v1/completions", json=BODY | {"prompt": PROMPT_B})
        async for _, data in events(live):
            rid = data["id"]
            break
        resume = f"{url}/v1/requests/{rid}/stream"
        async with s.get(resume, headers={"Last-Event-ID": "x"}) as resp:
            assert resp.status == 400
        async with s.get(resume, headers={"Last-Event-ID": "0"}) as resp:
            assert resp.status == 409  # its router streams it to its client
        live.close()
