"""Several tokens a step, through the whole stack: decode nodes run `--decode-ahead 3`
(shared/engine/ahead.py), so each of their deltas brings up to three tokens. Eight greedy
streams; once each has a few events, decode-1 is SIGKILLed. Every stream still ends with
exactly the uninterrupted text: the router orders deltas by token index, checkpoints and
tails cover the tokens of every inner step, and a resume continues after the last token
the client has (issue 50: nothing above the engine may assume one token per step).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.bus.server import free_port
from tandem.launcher import Stack
from tests.e2e.chaos import Request, Stream, failed_over, run_streams
from tests.e2e.conftest import running_stack, wait_for_every_node

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
