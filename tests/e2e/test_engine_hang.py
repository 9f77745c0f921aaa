"""A decode node whose engine thread hangs (not dies) mid-stream: its event loop still
answers probes and heartbeats, so only the node itself can tell. Within its stall timeout
(5 s in the test stack) it answers probes "stalled" and takes no work; its stream moves to
the other decode node and ends with the reference text. Released, it serves again."""

from __future__ import annotations

import asyncio
import os
import signal

import aiohttp
import pytest

from shared.model.loader import LoadedModel
from tandem.launcher import Stack
from tests.e2e.streaming import complete, registry, wait_for
from tests.e2e.test_api import reference, text_of
from tests.e2e.test_failover import router_metric

pytestmark = pytest.mark.e2e


async def test_a_hung_engine_is_found_out_and_its_stream_moves(
    stack: Stack, real_model: LoadedModel
) -> None:
    ids = real_model.encode(
        "Write at length about the history of mathematics, from Babylon to today."
    )
    n = 160
    ref_ids = reference(real_model, ids, n)
    assert len(ref_ids) == n  # no end of text before n: the stream runs long enough
    ref = text_of(real_model, ref_ids)
    unresponsive = router_metric(stack, "tandem_errors_total", type="node_unresponsive")
    holder: list[str] = []

    async def serving() -> bool:
        running = [node for node, (r, _) in (await registry(stack)).items() if r > 0]
        holder[:] = running
        return len(running) == 1

    async with aiohttp.ClientSession() as session:
        stream = asyncio.ensure_future(complete(session, stack.url, ids, n))
        await wait_for("the stream to run on a decode node", serving)
        victim = holder[0]
        pid = stack.child(victim).proc.pid  # type: ignore[union-attr]
        os.kill(pid, signal.SIGUSR1)  # its engine thread hangs; its event loop goes on
        try:

            async def draining() -> bool:
                return (await registry(stack)).get(victim, (0, False))[1]  # missed: ask again

            await wait_for(f"{victim} to say it takes no work", draining)
            assert await asyncio.wait_for(stream, 120) == ref  # moved, and exact
            assert router_metric(stack, "tandem_errors_total", type="node_unresponsive") > (
                unresponsive
            )
            # meanwhile new work goes to the other node
            other = real_model.encode("Name a colour.")
            assert await complete(session, stack.url, other, 8) == text_of(
                real_model, reference(real_model, other, 8)
            )
        finally:
            os.kill(pid, signal.SIGUSR2)

        async def healthy() -> bool:
            # a read that skipped its entry (one slow get under load) says nothing: ask again
            entry = (await registry(stack)).get(victim)
            return entry is not None and not entry[1]

        await wait_for(f"{victim} to take work again", healthy)
