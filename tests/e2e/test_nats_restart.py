"""NATS restarted under load: every service reconnects and in-flight streams finish exactly.

Deltas published while the server is away are lost (core NATS: at most once); the router
sees the gap in a stream's sequence and resumes the request after the tokens it has, so
the client still gets every token once. JetStream state (work queue, registry, journal)
is on disk and survives the restart.
"""

from __future__ import annotations

import asyncio

import pytest

from tandem.launcher import Stack
from tests.e2e.chaos import Request, Stream, run_streams
from tests.e2e.conftest import wait_ready

pytestmark = pytest.mark.e2e

STREAMS = 3
MAX_TOKENS = 100
RESTART_AFTER = 15


async def test_nats_restarted_mid_stream(
    stack: Stack, chaos_reference: tuple[list[Request], list[list[str]]]
) -> None:
    requests, pieces = chaos_reference  # their first MAX_TOKENS tokens
    requests = [Request(r.prompt_ids, MAX_TOKENS) for r in requests[-STREAMS:]]
    expected = ["".join(p[:MAX_TOKENS]) for p in pieces[-STREAMS:]]
    streams = [Stream() for _ in requests]
    assert stack.nats is not None

    async def restart() -> None:
        while min(s.events for s in streams) < RESTART_AFTER:
            await asyncio.sleep(0.05)
        # On this thread: the server dies with the thread that started it (PDEATHSIG), and
        # a worker thread of this test's loop ends with the loop.
        stack.nats.restart()  # type: ignore[union-attr]

    await asyncio.gather(run_streams(stack.url, requests, streams), restart())
    assert [s.text for s in streams] == expected  # nothing lost, nothing repeated
    await asyncio.to_thread(wait_ready, stack)
    # and new work flows: the work queue and registry came back with the server
    again = [Stream()]
    await run_streams(stack.url, requests[:1], again)
    assert again[0].text == expected[0]
