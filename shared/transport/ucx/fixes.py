"""Fixes for four ucxx 0.52 bugs that the UCX transport would otherwise hit, and one hook;
applied once.

Each patches ucxx's Python layer (pinned by the ucxx version in pyproject.toml):

- Blocking progress never re-arms (an idle node spins a whole core).
- Its progress watchdog task can swallow its own cancellation (a process never ends).
- The re-arm above can start a new task while the event loop is closing (a pending task
  destroyed with the loop).
- The endpoint handshake frees a buffer that UCX still writes into when it is cancelled
  (heap corruption: a later, unrelated crash).
- The hook: `after_progress` callbacks run after every progress of the worker in blocking
  mode, which is when arrived messages and completed operations become visible (the
  transport waits for both this way instead of spinning: `waits`).
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("tandem.transport.ucx")

# Called after every progress of a worker in blocking mode (see _ProgressNotifier).
after_progress: list[Callable[[], None]] = []
notifying = False  # whether a blocking-mode worker runs them (other modes do not)


def apply() -> None:
    """Apply every fix: once per process, before ucxx.init (`transport._ucxx` does)."""
    _fix_blocking_progress()
    _fix_progress_watchdog()
    _fix_handshake_buffers()
    _wrap_blocking_mode()


def _fix_blocking_progress() -> None:
    """Re-arm ucxx's blocking progress after each worker event (ucxx 0.52 never does).

    Its `BlockingMode` arms the worker's event fd once; the fd's reader callback then
    progresses the worker but never schedules the re-arm, so after the first event the fd
    stays readable and the event loop spins on it forever: every node that had ever moved
    a byte burned a whole core while idle, which on 2 cores starved the engines (decode
    steps 10x slower). ucx-py scheduled the re-arm in the callback; this restores that.
    """
    from ucxx._lib_async.continuous_ucx_progress import BlockingMode

    def _fd_reader_callback(self: Any) -> None:
        self.worker.progress()
        if getattr(self, "closing", False):
            return  # the loop is closing: a new task would outlive it (_guard_close)
        if self.arm_task is None or self.arm_task.done():
            self.arm_task = self.event_loop.create_task(self._arm_worker())

    BlockingMode._fd_reader_callback = _fd_reader_callback  # type: ignore[method-assign]


def _fix_progress_watchdog() -> None:
    """Let blocking progress's watchdog task be cancelled while it waits for the arm task.

    Every second without progress, ucxx's `_progress_with_timeout` cancels the arm task and
    awaits it inside `except CancelledError: pass`. A cancellation of the watchdog itself
    that lands in that await (asyncio.run cancelling every task at the end) is swallowed
    too, and the task goes on sleeping and polling forever: asyncio.run waits for it, and
    the process never ends. Waiting with `asyncio.wait` instead takes the arm task's end
    without raising it, so only the watchdog's own cancellation propagates.
    """
    from ucxx._lib_async.continuous_ucx_progress import BlockingMode

    async def _progress_with_timeout(self: Any) -> None:
        while True:
            worker = self.worker
            if worker is None:
                return
            if time.monotonic() > self.last_progress_time + self._progress_timeout:
                self.last_progress_time = time.monotonic()
                arm = self.arm_task
                if arm is not None:
                    arm.cancel()  # re-created on the next worker event
                    await asyncio.wait([arm])
                worker.progress()
            await asyncio.sleep(self._progress_timeout)

    BlockingMode._progress_with_timeout = _progress_with_timeout  # type: ignore[method-assign]


def _guard_close(mode: Any, worker: Any, event_loop: Any) -> None:
    """Start no arm task once blocking progress's event loop begins to close.

    ucxx wraps `loop.close` to cancel the arm and watchdog tasks, running the loop until
    each ends. A worker event in those runs called the reader callback, whose re-arm
    (`_fix_blocking_progress`) started a fresh arm task that nothing cancelled: the loop
    closed with it pending ("Task was destroyed but it is pending", an error at a test's
    teardown in CI). Closing now first stops reading the event fd and marks the mode
    closing, so the callback no longer re-arms.
    """
    mode.closing = False
    close = event_loop.close  # ucxx's wrapper, which cancels the tasks
    epoll_fd = worker.epoll_file_descriptor

    def _close(*args: Any, **kwargs: Any) -> None:
        if not event_loop.is_closed():
            mode.closing = True
            event_loop.remove_reader(epoll_fd)
        close(*args, **kwargs)

    event_loop.close = _close


# Handshake requests that ended early (a timeout, a cancelled caller), with the buffers
# UCX may still write into or read from; dropped once UCX has finished with them.
_parked: list[tuple[Any, tuple[Any, ...]]] = []
PARKED_WARN = 256


def _park(request: Any, buffers: tuple[Any, ...]) -> None:
    _parked[:] = [entry for entry in _parked if not entry[0].completed]
    if not request.completed:
        _parked.append((request, buffers))
        if len(_parked) == PARKED_WARN:
            log.warning("%d UCX handshakes still pending after their callers left", PARKED_WARN)


async def _exchange_peer_info(
    endpoint: Any, msg_tag: int, listener: bool, connect_timeout: float = 5.0
) -> dict[str, int]:
    """ucxx's endpoint handshake, except that buffers outlive a request that ends early.

    ucxx posts a 16-byte stream receive into a local bytearray and awaits it under
    `wait_for`; when that await is cancelled (its own connect timeout, or a caller's
    deadline around `create_endpoint`) the bytearray is freed while the receive is still
    posted, and the peer's handshake, arriving later, is written into freed memory. That
    corrupted the heap and crashed the process later, somewhere unrelated (seen in CI as a
    segfault hashing in the next `create_endpoint`, and reproduced by sending with a few ms
    of deadline). Same wire format as ucxx's: two u64, the tag and its hash.
    """
    from ucxx._lib.arr import Array
    from ucxx._lib_async.utils import hash64bits

    fmt = "QQ"
    mine = struct.pack(fmt, msg_tag, hash64bits(msg_tag))
    theirs = bytearray(len(mine))
    mine_arr, theirs_arr = Array(mine), Array(theirs)
    buffers = (mine, theirs, mine_arr, theirs_arr)
    steps = ("send", "recv") if listener else ("recv", "send")
    for step in steps:  # one at a time: ucx-py found interleaved stream calls unsafe
        if step == "send":
            request = endpoint.stream_send(mine_arr)
        else:
            request = endpoint.stream_recv(theirs_arr)
        try:
            # Not wait_for: on Python 3.11 it swallows a cancellation that arrives as the
            # request completes, and a caller's deadline (asyncio.timeout around the
            # whole send) then silently never fires: a send ran 0.1 s past its 20 ms.
            async with asyncio.timeout(connect_timeout):
                await request.wait()
        except BaseException:
            _park(request, buffers)
            raise
    tag, checksum = struct.unpack(fmt, theirs)
    if hash64bits(tag) != checksum:
        raise RuntimeError("UCX handshake: peer info checksum invalid")
    return {"msg_tag": tag, "checksum": checksum}


def _fix_handshake_buffers() -> None:
    from ucxx._lib_async import application_context, listener

    application_context.exchange_peer_info = _exchange_peer_info  # type: ignore[attr-defined]
    listener.exchange_peer_info = _exchange_peer_info  # type: ignore[attr-defined]


class _ProgressNotifier:
    """Stands in for blocking mode's worker: its progress() also runs `after_progress`.

    Blocking mode progresses the worker in three places (the event fd's reader, the arm
    loop, the watchdog), each through its `worker` attribute; wrapping that one object
    reaches all three without copying them."""

    def __init__(self, worker: Any) -> None:
        self._worker = worker

    def progress(self) -> None:
        self._worker.progress()
        for callback in after_progress:
            try:
                callback()
            except Exception:  # a bug guard: progress must go on whatever a callback does
                log.exception("after_progress callback failed")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._worker, name)


def _wrap_blocking_mode() -> None:
    """Blocking mode's constructor, wrapped once for both of its changes: the loop's close
    guarded (`_guard_close`), and its worker one that runs `after_progress`."""
    from ucxx._lib_async.continuous_ucx_progress import BlockingMode

    original = BlockingMode.__init__

    def __init__(self: Any, worker: Any, event_loop: Any, *args: Any, **kwargs: Any) -> None:
        global notifying
        original(self, worker, event_loop, *args, **kwargs)
        _guard_close(self, worker, event_loop)
        self.worker = _ProgressNotifier(self.worker)  # its tasks have not run yet
        notifying = True

    BlockingMode.__init__ = __init__  # type: ignore[method-assign]
