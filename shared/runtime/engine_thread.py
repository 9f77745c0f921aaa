"""The one thread on which a model node builds its engine and makes every call into it.

One thread, in order, means the engine needs no locks and the event loop stays free for
NATS and the data plane while a step computes. Building the engine there too matters for
speed: torch's CPU kernels run on OpenMP, and libgomp gives each thread that starts a
parallel region a team of its own. Once a process holds more such threads than it has
cores, every team spins only briefly at its barriers before sleeping, so each op's workers
must be woken again. Loading the model on the main thread left a second, idle team behind,
and the engine thread's steps then ran 1.2-1.5x slower in the serving stack than in the
engine benchmark (docs/benchmarks-log.md, "One OpenMP team"). With every torch op on this
thread, the process has one team.

The thread can also run on CPUs of its own (`cpus`): on Linux a thread's affinity is its
own, so the engine's steps can have a core that nothing else in the process, nor the
processes the launcher placed elsewhere, competes for (`tandem up --isolate-decode`).
Threads the engine thread starts (torch's OpenMP workers) inherit its CPUs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from shared.errors import TandemError

T = TypeVar("T")


class EngineThread:
    """A single worker thread; `call` runs a function on it from the event loop.

    It also tells whether the engine makes progress: `busy_for()` is how long the call
    running now has run (0 when idle). A step takes ~0.1-1 s; a call running for many
    seconds is a hung engine, which the node then reports (see the decode worker)."""

    def __init__(self, cpus: set[int] | None = None) -> None:
        self.cpus = cpus
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine")
        self.running_since: float | None = None  # time.monotonic() the running call began
        self.completed = 0  # calls finished
        self._frozen: threading.Event | None = None

    def _timed(self, fn: Callable[..., T], *args: Any) -> T:
        self.running_since = time.monotonic()
        try:
            return fn(*args)
        finally:
            self.running_since = None
            self.completed += 1

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, self._timed, fn, *args)

    async def pin(self) -> None:
        """Move the thread onto its CPUs, if it has any. Call it before the first other call
        (before the engine is built: torch's threads start with the CPUs of the thread that
        starts them). A CPU this host does not have, or may not use, is a clear error."""
        if self.cpus:
            try:
                await self.call(os.sched_setaffinity, 0, self.cpus)  # pid 0: this thread alone
            except OSError as e:
                raise TandemError(
                    f"cannot run the engine thread on CPUs {sorted(self.cpus)} (this process "
                    f"may use {sorted(os.sched_getaffinity(0))}): {e.strerror}"
                ) from None

    def busy_for(self) -> float:
        since = self.running_since
        return 0.0 if since is None else time.monotonic() - since

    def freeze(self) -> None:
        """Test-only fault injection: the engine thread hangs (until `thaw`) after the call
        it runs now, while the event loop goes on (shared/runtime/faults.py)."""
        if self._frozen is None:
            self._frozen = threading.Event()
            self.executor.submit(self._timed, self._frozen.wait)

    def thaw(self) -> None:
        if self._frozen is not None:
            self._frozen.set()
            self._frozen = None

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
