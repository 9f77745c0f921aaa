"""Awaiting ucxx without spinning: posted operations, and idle endpoints' next message.

ucxx's own waits busy-yield on the event loop until their request completes (its
`wait_yield`: ucxx has no completion futures outside its thread progress mode, and that
mode breaks as soon as a process uses a second event loop). Here every wait is a future
resolved by a check after each progress of the worker (`Notices`, run by the hook in
`fixes`). Spinning made an idle node burn a core, held the GIL beside a decode
node's engine thread during every transfer, and with two processes spinning on 2 cores
each hop of a transfer after an idle spell took ms (docs/benchmarks-log.md). Uses ucxx
internals (`_ep`, `_tags`), pinned by the ucxx version in pyproject.toml.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from shared.transport.ucx import fixes

IDLE_POLL_MAX = 0.005  # seconds between probes of an idle endpoint, at most, when polling
IDLE_RECHECK = 0.1  # seconds between checks of an idle endpoint woken after each progress
REQUEST_RECHECK = 0.01  # the same for a posted operation


class Notices:
    """Conditions awaited on the worker (an idle endpoint's next message, a posted
    operation's completion), checked after each progress of the worker.

    In blocking mode whatever the network brings makes the worker's event fd readable and
    is taken in by the progress that follows; `fixes.after_progress` runs `check`
    right after it, so a waiter learns of its message, its completion or its peer's death
    (which UCX also finds during a progress) at once, without polling.
    """

    def __init__(self) -> None:
        self.waiting: dict[asyncio.Future[None], Callable[[], bool]] = {}

    async def wait(self, ready: Callable[[], bool], recheck: float) -> None:
        """Return once `ready()`; checked after each progress and every `recheck` seconds
        (a safety net for a progress outside blocking mode's, never the usual path)."""
        loop = asyncio.get_running_loop()
        while not ready():
            notice: asyncio.Future[None] = loop.create_future()
            self.waiting[notice] = ready
            try:
                await asyncio.wait([notice], timeout=recheck)
            finally:
                del self.waiting[notice]

    def check(self) -> None:
        for notice, ready in list(self.waiting.items()):
            if not notice.done() and ready():
                notice.set_result(None)


def _failed(ep: Any) -> bool:
    try:
        ep._ep.raise_on_error()
    except Exception:
        return True
    return False


notices = Notices()


async def completion(request: Any) -> None:
    """Await a posted ucxx request, raising its error (ucxx's `wait` outside blocking
    mode, which has no notices)."""
    if fixes.notifying:
        await notices.wait(lambda: bool(request.completed), REQUEST_RECHECK)
        request.check_error()
    else:
        await request.wait()


def _check_open(ep: Any) -> None:
    """Raise as ucxx's own send and receive do before posting: the endpoint's error (its
    peer died) or that it is closed."""
    from ucxx.exceptions import UCXCloseError

    ep._ep.raise_on_error()
    if ep.closed:
        raise UCXCloseError("Endpoint closed")


async def send(ep: Any, buf: memoryview) -> None:
    """ucxx's `Endpoint.send`, awaited without spinning."""
    from ucxx._lib.arr import Array
    from ucxx.types import Tag

    _check_open(ep)
    arr = Array(buf)  # held until UCX is done with it
    await completion(ep._ep.tag_send(arr, Tag(ep._tags["msg_send"])))


async def recv(ep: Any, buf: memoryview) -> None:
    """ucxx's `Endpoint.recv`, awaited without spinning (a message is only ever awaited on
    a live endpoint here: an endpoint that failed is dropped, whatever it had queued)."""
    from ucxx._lib.arr import Array
    from ucxx.types import Tag, TagMaskFull

    _check_open(ep)
    arr = Array(buf)
    await completion(ep._ep.tag_recv(arr, Tag(ep._tags["msg_recv"]), TagMaskFull))


async def until_message(ep: Any) -> None:
    """Wait, without a posted receive, until a message for `ep` has arrived.

    An endpoint pooled between transfers must not hold a posted receive (awaiting it is
    the spin this module avoids) nor poll: probing each idle endpoint ~200 times a second
    kept a process with 8 of them at 3.2% of a core doing nothing, 0.4% with notices.
    Outside blocking mode there are no notices: it probes with a growing pause up to
    IDLE_POLL_MAX, which then delays a transfer's first message by at most that.
    """
    import ucxx  # initialised by shared.transport.ucx.transport, the only caller
    from ucxx.types import Tag

    tag = Tag(ep._tags["msg_recv"])
    worker = ucxx.core._get_ctx().worker
    pause = 0.0
    while not worker.tag_probe(tag).matched:
        if ep.closed:
            raise ConnectionError("endpoint closed")
        ep._ep.raise_on_error()  # the peer died or closed: UCX marked the endpoint
        if not fixes.notifying:
            await asyncio.sleep(pause)
            pause = min(IDLE_POLL_MAX, pause * 1.5 + 0.0001)
            continue
        await notices.wait(
            lambda: ep.closed or worker.tag_probe(tag).matched or _failed(ep), IDLE_RECHECK
        )
