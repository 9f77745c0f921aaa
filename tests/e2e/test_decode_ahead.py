"""Several tokens a step, through the whole stack: decode nodes run `--decode-ahead 3`
(shared/engine/ahead.py), so each of their deltas brings up to three tokens.

- The router SIGKILLed mid-stream: the client resumes (`Last-Event-ID`) on the restarted
  router and gets exactly the rest, however the regenerated tokens are grouped.
- Eight greedy streams; once each has a few events, decode-1 is SIGKILLed. Every stream
  still ends with exactly the uninterrupted text: the router orders deltas by token index,
  checkpoints and tails cover the tokens of every inner step, and a resume continues after
  the last token the client has.

Issue 50: nothing above the engine may assume one token per step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from shared.bus.server import free_port
from tandem.launcher import Stack
from tests.e2e.chaos import Request, Stream, failed_over, run_streams
from tests.e2e.conftest import running_stack, wait_for_every_node, wait_ready
from tests.e2e.test_api import MODEL
from tests.e2e.test_router_restart import RESUMABLE, events, text

pytestmark = pytest.mark.e2e

AHEAD = 3
STREAMS = 8
MAX_TOKENS = 60
KILL_AFTER = 6  # events (up to AHEAD tokens each) every stream has when decode-1 dies


@pytest.fixture(scope="module")
def ahead_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Path]]:
    argv = [
        "--prefill", "1",
        "--decode", "2",
        "--port", str(free_port()),
        "--kv-cache-mb", "512",
        "--heartbeat-ttl", "2",
    ]  # fmt: skip
    log = tmp_path_factory.mktemp("ahead") / "stack.log"
    with running_stack(argv, log, env={"TANDEM_DECODE_AHEAD": str(AHEAD)}) as s:
        wait_for_every_node(s, timeout=300)
        yield s, log


async def test_a_client_resumes_a_dead_routers_stream(
    ahead_stack: tuple[Stack, Path], chaos_reference: tuple[list[Request], list[list[str]]]
) -> None:
    stack, _ = ahead_stack
    requests, pieces = chaos_reference
    expected = "".join(pieces[1][:MAX_TOKENS])
    body = {"model": MODEL, "prompt": requests[1].prompt_ids, "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    got: list[str] = []
    last, rid, several = -1, "", False
    url = stack.url + "/v1/completions"
    async with aiohttp.ClientSession() as s, s.post(url, json=body, headers=RESUMABLE) as resp:
        async for event_id, data in events(resp):
            assert event_id is not None and event_id > last
            several |= event_id > last + 1  # an event of several tokens
            rid, last = data["id"], event_id
            got.append(text(data))
            if event_id >= 20:
                break
        # killed while the connection is still open: a client seen to leave first would
        # have its request cancelled (and its journal entry gone) by the router
        await asyncio.to_thread(stack.kill, "router")
    assert several
    stack.restart("router")
    await asyncio.to_thread(wait_ready, stack)
    async with aiohttp.ClientSession() as s:
        resume = f"{stack.url}/v1/requests/{rid}/stream"
        async with s.get(resume, headers={"Last-Event-ID": str(last)}) as resp:
            assert resp.status == 200, await resp.text()
            async for event_id, data in events(resp):
                if data == "[DONE]":
                    break
                assert event_id is not None and event_id > last
                last = event_id
                got.append(text(data))
    assert "".join(got) == expected  # no gap, no repeat
    assert last == MAX_TOKENS - 1


async def test_streams_of_several_tokens_a_delta_survive_a_decode_node_kill(
    ahead_stack: tuple[Stack, Path], chaos_reference: tuple[list[Request], list[list[str]]]
) -> None:
    stack, log = ahead_stack
    requests, pieces = chaos_reference
    requests = [Request(r.prompt_ids, MAX_TOKENS) for r in requests[:STREAMS]]
    expected = ["".join(p[:MAX_TOKENS]) for p in pieces[:STREAMS]]
    streams = [Stream() for _ in requests]

    async def kill() -> None:
        while min(s.events for s in streams) < KILL_AFTER:
            await asyncio.sleep(0.05)
        await asyncio.to_thread(stack.kill, "decode-1")

    await asyncio.gather(run_streams(stack.url, requests, streams), kill())
    assert [s.text for s in streams] == expected  # no gap, no repeat
    assert failed_over(log), "decode-1 served none of the streams?"
    # several tokens an event: the prefill node's first token alone, then up to AHEAD
    events = sum(s.events for s in streams)
    assert events < STREAMS * (1 + (MAX_TOKENS - 1) / 2), events
