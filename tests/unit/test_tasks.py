"""Background tasks stop within a bound even when Python 3.11's wait_for loses a cancellation."""

from __future__ import annotations

import asyncio
import contextlib
import sys

import pytest

from shared.tasks import cancel_and_wait

pytestmark = pytest.mark.unit


async def publisher(first: asyncio.Future[None], rounds: list[int]) -> None:
    """Like a background publisher: a request through wait_for, then its loop."""
    await asyncio.wait_for(first, 5.0)
    while True:
        rounds.append(1)
        await asyncio.sleep(0.02)


async def started(first: asyncio.Future[None], rounds: list[int]) -> asyncio.Task[None]:
    task = asyncio.create_task(publisher(first, rounds))
    await asyncio.sleep(0)  # it now waits in wait_for
    first.set_result(None)  # the answer arrives in the turn the cancellation will
    return task


async def test_a_cancellation_lost_in_wait_for_leaves_the_task_running() -> None:
    """The premise (3.11 only): `task.cancel(); await task` would wait forever."""
    if sys.version_info >= (3, 12):
        pytest.skip("wait_for no longer loses cancellations on this Python")
    rounds: list[int] = []
    task = await started(asyncio.get_running_loop().create_future(), rounds)
    task.cancel()
    await asyncio.sleep(0.2)
    assert not task.done() and rounds, "the cancellation was not lost after all"
    task.cancel()  # a second one lands on its sleep
    await asyncio.wait([task], timeout=1)
    assert task.cancelled()


async def test_cancel_and_wait_stops_a_task_whose_cancellation_was_lost() -> None:
    loop = asyncio.get_running_loop()
    task = await started(loop.create_future(), [])
    started_at = loop.time()
    assert await cancel_and_wait(task, timeout=5.0)
    assert task.cancelled() and loop.time() - started_at < 1.0


async def test_cancel_and_wait_gives_up_on_a_task_that_ignores_cancelling() -> None:
    released = asyncio.Event()

    async def stubborn() -> None:
        while not released.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0.05)

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    assert not await cancel_and_wait(task, None, timeout=0.3)
    assert not task.done()
    released.set()
    await task
