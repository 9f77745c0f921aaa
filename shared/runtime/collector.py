"""Python's cyclic garbage collector paused around work that makes many objects and no
reference cycles (a simulated hour of a cluster, the metrics over its million records):
each full pass would walk every object made so far, ever more of them, and free nothing."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic collection inside (reference counting still frees everything it can);
    the collector as it was after."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()
