"""The router's one tokenising thread, shared fairly between API keys.

Tokenising and chat templating a prompt up to the body limit take up to ~0.1-1 s: on the
event loop they would stall every stream, so one thread does them, one call at a time (a
tokenizer object is not safe to share between threads in every version). Its queue is
bounded by admission (the calls waiting count as in flight, `InFlight.admit`), and shared
fairly: each key's calls wait in a queue of their own and the thread takes the keys in
turn, so a key sending many long prompts delays another key's next call by at most one of
its own, not by its whole backlog (issue 49). An open API is one key ("").
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

Call = tuple[Callable[..., Any], tuple[Any, ...], "asyncio.Future[Any]"]


class FairThread:
    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self._queues: dict[str, deque[Call]] = {}
        self._turns: deque[str] = deque()  # keys with calls waiting, in the order served
        self._busy = False
        self.calls = 0  # run so far (tests, metrics)

    async def run(self, key: str, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the thread, in `key`'s turn."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = deque()
            self._turns.append(key)
        queue.append((fn, args, future))
        self._next()
        return await future

    def waiting(self, key: str) -> int:
        return len(self._queues.get(key, ()))

    def _next(self) -> None:
        """Start the next call: the first waiting of the key whose turn it is."""
        while not self._busy and self._turns:
            key = self._turns.popleft()
            queue = self._queues[key]
            fn, args, future = queue.popleft()
            if queue:
                self._turns.append(key)  # its next call waits for the other keys' turns
            else:
                del self._queues[key]
            if future.cancelled():  # its client left while it waited
                continue
            self._busy = True
            self._thread.submit(fn, *args).add_done_callback(
                self._on_thread_done(asyncio.get_running_loop(), future)
            )

    def _on_thread_done(
        self, loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any]
    ) -> Callable[[Future[Any]], None]:
        """What the thread calls when a call ends: hand it back to the event loop."""

        def on_done(done: Future[Any]) -> None:
            loop.call_soon_threadsafe(self._finished, done, future)

        return on_done

    def _finished(self, done: Future[Any], future: asyncio.Future[Any]) -> None:
        self._busy = False
        self.calls += 1
        if not future.cancelled():
            exc = done.exception()
            if exc is not None:
                future.set_exception(exc)
            else:
                future.set_result(done.result())
        self._next()
