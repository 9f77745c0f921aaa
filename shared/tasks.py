"""Stopping background tasks in bounded time, even when a cancellation is lost.

On Python 3.11, `asyncio.wait_for` returns its result and drops a cancellation that arrives
in the loop turn in which its inner future completes (3.12 rewrote it). nats-py's requests
and JetStream publishes run through it, so a background task cancelled while one completes
runs on as if nothing happened, and `task.cancel(); await task` then waits forever. Seen in
CI: a kvcache node ignored SIGTERM because its KV-event publisher, cancelled mid-publish,
went back to its loop. `cancel_and_wait` cancels again while a task runs on, and gives up
(logged) after a bound. `WakeLoop` is a background task woken to do rounds of work, stopped
that way.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger("tandem.tasks")

RECANCEL_EVERY = 0.1  # seconds between cancellations of a task that runs on


async def cancel_and_wait(*tasks: asyncio.Future[Any] | None, timeout: float = 5.0) -> bool:
    """Cancel every task and wait for all to end, within `timeout`; True if they all did.

    Their results and errors are dropped: a task being stopped has nobody to report to.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    left = {t for t in tasks if t is not None}
    while left := {t for t in left if not t.done()}:
        remaining = deadline - loop.time()
        if remaining <= 0:
            names = ", ".join(sorted(_name(t) for t in left))
            log.warning("still running %.1fs after cancelling: %s", timeout, names)
            return False
        for task in left:
            task.cancel()
        await asyncio.wait(left, timeout=min(RECANCEL_EVERY, remaining))
    for ended in tasks:
        if ended is not None and ended.done() and not ended.cancelled():
            ended.exception()  # retrieved, so asyncio does not log it as never retrieved
    return True


def _name(task: asyncio.Future[Any]) -> str:
    return task.get_name() if isinstance(task, asyncio.Task) else repr(task)


class WakeLoop:
    """A background task that runs `round` each time it is woken: the shape of every
    uploader here (blocks, tails, checkpoint records). Wakes during a round make one more
    round after it, and rounds start at least `min_interval` seconds apart (wakes in
    between merge into the next)."""

    def __init__(self, round: Callable[[], Awaitable[None]], min_interval: float = 0.0) -> None:
        self.round = round
        self.min_interval = min_interval
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def wake(self) -> None:
        self._wake.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        started = -1e9
        while True:
            await self._wake.wait()
            if self.min_interval > 0:  # what is submitted while this waits merges in
                await asyncio.sleep(max(0.0, started + self.min_interval - loop.time()))
            self._wake.clear()
            started = loop.time()
            await self.round()

    async def close(self) -> None:
        await cancel_and_wait(self._task)
