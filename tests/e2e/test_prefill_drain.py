"""Prefill nodes stopped gracefully (SIGTERM) with jobs still queued for them: they drain.

Every prefill node of the stack is stopped at once, as a scale-down to none of a
conditional router's pool would, while the jobs of a burst still wait in the shared
queue: the nodes say they are draining and serve what is queued before they exit, so
every request of the burst ends with its full text. (Before they drained, the queued
jobs waited for a prefill node that never came.) The nodes are restarted afterwards so
the package's stack stays whole for other tests.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from shared.model.loader import LoadedModel
from tandem.launcher import Stack
from tests.e2e.chaos import Request, Stream, reference, run_streams, workload
from tests.e2e.conftest import wait_for_every_node
from tests.e2e.test_failover import router_metric

pytestmark = pytest.mark.e2e

BURST = 32  # 2 nodes fetch 4 jobs a batch: most of the burst is queued at the stop
MAX_TOKENS = 4
PREFILL = ("prefill-1", "prefill-2")
ROUTES = "tandem_router_routes_total"


async def test_prefill_nodes_stopped_with_jobs_queued_serve_them_first(
    stack: Stack, real_model: LoadedModel
) -> None:
    # prompts of this test alone: one a node's pool held from another test would be
    # prefilled on that decode node, never queued for a prefill node
    requests = [Request(r.prompt_ids, MAX_TOKENS) for r in workload(real_model, BURST, 0, 41)]
    expected = ["".join(p) for p in reference(real_model, requests)]
    streams = [Stream() for _ in requests]
    log = Path(stack.out.name)
    drained_before = log.read_text().count("drained:")

    def routed() -> float:
        return sum(router_metric(stack, ROUTES, route=r) for r in ("local", "remote"))

    want = routed() + BURST

    async def stop() -> None:
        # every request admitted first: a split router with no prefill node taking work
        # turns new requests away (503), which is not what is tested here
        while await asyncio.to_thread(routed) < want:
            await asyncio.sleep(0.02)
        for name in PREFILL:
            await asyncio.to_thread(stack.terminate, name)

    try:
        await asyncio.wait_for(
            asyncio.gather(run_streams(stack.url, requests, streams), stop()), 180
        )
        for name in PREFILL:
            proc = stack.child(name).proc
            assert proc is not None
            assert await asyncio.to_thread(proc.wait, 60) == 0, name
    finally:
        for name in PREFILL:
            stack.restart(name)
    assert [s.text for s in streams] == expected
    # the nodes said what they served after the stop (the burst had jobs left queued)
    lines = [line for line in log.read_text().splitlines() if "drained:" in line]
    assert len(lines) - drained_before == len(PREFILL), lines
    assert any(" 0 jobs" not in line for line in lines[drained_before:]), lines
    await asyncio.to_thread(wait_for_every_node, stack, 300)
