"""Process-level settings every Tandem process applies at start."""

from __future__ import annotations

import os


def configure_threads(threads: int | None) -> int:
    """Set torch's thread count to the cores this process may use, and return it.

    Oversubscribed cores are catastrophic for decode latency (measured 7-17x slower per
    step with two busy processes on two cores), so each process takes exactly the cores
    its affinity mask grants unless told otherwise.
    """
    import torch

    n = threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(max(1, n))
    return n
