"""The one thread on which a model node builds its engine and makes every call into it.

One thread, in order, means the engine needs no locks and the event loop stays free for
NATS and the data plane while a step computes. Building the engine there too matters for
speed: torch's CPU kernels run on OpenMP, and libgomp gives each thread that starts a
parallel region a team of its own. Once a process holds more such threads than it has
cores, every team spins only briefly at its barriers before sleeping, so each op's workers
must be woken again. Loading the model on the main thread left a second, idle team behind,
and the engine thread's steps then ran 1.2-1.5x slower in the serving stack than in the
engine benchmark (docs/benchmarks.md, "One OpenMP team"). With every torch op on this
thread, the process has one team.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class EngineThread:
    """A single worker thread; `call` runs a function on it from the event loop."""

    def __init__(self) -> None:
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine")

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
