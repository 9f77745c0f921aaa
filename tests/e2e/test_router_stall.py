"""A fault case of issue 49: the router's event loop stalled beyond the heartbeat TTL.

The router is SIGSTOPped for 4x the stack's heartbeat TTL while 6 greedy streams run, then
SIGCONTed. Meanwhile its registry entry lapses and the decode nodes go on generating; the
nodes' entries look unrefreshed to it when it wakes. What the system promises (docs/
architecture.md, "Failover"): every stream still ends exactly as uninterrupted (no gap, no
repeat, no error), whether its tokens waited in NATS for the router or a failover it
started on waking resumed them.
"""

from __future__ import annotations

import asyncio
import signal

import pytest

from tandem.launcher import Stack
from tests.e2e.chaos import Request, Stream, run_streams
from tests.e2e.test_failover import failovers

pytestmark = pytest.mark.e2e

STREAMS = 6
MAX_TOKENS = 64
STALL = 8.0  # seconds; the package stack's heartbeat TTL is 2


async def test_streams_survive_a_router_stalled_past_its_heartbeat_ttl(
    stack: Stack, chaos_reference: tuple[list[Request], list[list[str]]]
) -> None:
    requests, pieces = chaos_reference
    picked = range(16, 16 + STREAMS)
    requests = [Request(requests[i].prompt_ids, MAX_TOKENS) for i in picked]
    expected = ["".join(pieces[i][:MAX_TOKENS]) for i in picked]
    streams = [Stream() for _ in requests]
    router = stack.child("router").proc
    assert router is not None
    before = failovers(stack)

    async def stall() -> None:
        while min(s.events for s in streams) < 8:
            await asyncio.sleep(0.05)
        router.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(STALL)
        finally:
            router.send_signal(signal.SIGCONT)

    try:
        await asyncio.gather(run_streams(stack.url, requests, streams), stall())
    finally:
        router.send_signal(signal.SIGCONT)
    assert [s.text for s in streams] == expected
    print(f"failovers during the stall: {failovers(stack) - before:.0f}")
