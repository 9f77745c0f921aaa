"""Running a service's main coroutine: one-line errors, a bounded end, and a collector
that leaves the start-up objects alone.

A TandemError (bad model, bad option) ends the process with one line and exit 2; once the
service's own shutdown is done, tasks it left behind get a few seconds before the process
exits anyway.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import sys
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

from shared.errors import Stopped, TandemError
from shared.tasks import cancel_and_wait

log = logging.getLogger("tandem.service")

LEFTOVER_GRACE = 5.0  # seconds for tasks still running once a service has shut down


def run_service(
    serve: Callable[[argparse.Namespace], Coroutine[Any, Any, None]], args: argparse.Namespace
) -> int:
    """Run a service's coroutine; a TandemError (bad model, bad option) is one line, exit 2."""
    try:
        asyncio.run(_with_bounded_end(serve(args)))
    except TandemError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Stopped as exc:
        print(f"stopped: {exc}", file=sys.stderr)
    return 0


def freeze_startup_objects() -> None:
    """Collect once, then keep everything alive now out of later collections.

    A model node holds ~410,000 objects once its model, tokenizer and libraries are loaded,
    and a full collection walks them all: 95-125 ms measured, and up to 165 ms inside a
    decode node under load, during which the GIL is held and every stream's next token
    waits. They live as long as the process, so the collector has nothing to find there.
    Call once start-up is done (what is garbage by then is collected first, not frozen)."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def objects_frozen() -> Iterator[None]:
    """`freeze_startup_objects` for the length of a block, then the heap as it was: for a
    process whose timed work is one part of its life (the load generator's run, whose own
    full collections, 94-120 ms measured, delayed the chunks it was timing)."""
    freeze_startup_objects()
    try:
        yield
    finally:
        gc.unfreeze()


async def _with_bounded_end(service: Coroutine[Any, Any, None]) -> None:
    try:
        await service
    finally:
        await end_leftover_tasks(LEFTOVER_GRACE)


async def end_leftover_tasks(grace: float) -> None:
    """Cancel the tasks a stopped service left running and wait for them, within `grace`.

    asyncio.run does the same but waits without a bound, so one task that swallows its
    cancellation keeps a stopped node alive until its orchestrator SIGKILLs it. A task
    still running after `grace` (cancelled again while it runs on: shared/tasks.py) is
    logged with where it waits, and the process ends at once (exit 1) with its logs and
    traces flushed.
    """
    me = asyncio.current_task()
    left = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
    if await cancel_and_wait(*left, timeout=grace):
        return
    stuck = [t for t in left if not t.done()]
    for task in stuck:
        frames = " <- ".join(
            f"{f.f_code.co_name} ({os.path.basename(f.f_code.co_filename)}:{f.f_lineno})"
            for f in reversed(task.get_stack())
        )
        log.warning("task %s ignored cancellation at shutdown: %s", task.get_name(), frames)
    from shared.telemetry.tracing import flush_tracing

    flush_tracing()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)  # asyncio.run would wait for the stuck task forever
