"""Lending cores between the model nodes of one host: a decode node runs its steps on
every core while the prefill nodes beside it are idle, and gives theirs back when one
has a prompt to compute.

Why: `tandem up` on a small host splits its cores between the nodes (one each on two
cores), so a steady decode batch ran on half the machine while the prefill node sat
idle most of the time, and the disaggregated stack lost to one colocated node on
throughput (docs/benchmarks-log.md, "Lending cores"). Giving the decode node both
threads outright does not work: three busy OpenMP threads on two cores made each step
several times slower, since every op's barrier waits for a thread the kernel has
descheduled. So the nodes take turns, through a few bytes of shared memory:

- byte 0 is the decode node's: 1 while a step that uses the lent cores runs;
- byte 1 + i is prefill node i's: 1 while it computes, or wants to.

A prefill node sets its byte, then waits (at most `CLAIM_WAIT` seconds) for the decode
node's byte to clear, which takes at most the step running now; then it computes on its
own cores, and clears its byte. Before each step the decode node reads the prefill
bytes: all clear, it marks its byte and runs on `lend` threads; any set, on `base`. The
order (the decode node marks, then reads; the prefill node marks, then reads) leaves at
worst a step that overlaps a prefill, never a wrong result: the bytes only choose
thread counts. A node that starts clears its own byte (a killed one may have left it set);
a decode node's byte still set after a whole wait (dead or hung) is not waited for again
until it is seen clear. A prefill node killed mid-batch leaves the decode node on its own
share until that prefill node starts again.

Only for nodes that share cores: the launcher passes the same `--core-share` file to a
host's one decode node and its prefill nodes when none is pinned to cores of its own.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import time
from pathlib import Path

import torch

SLOTS = 64  # the file's size: the decode node's byte and up to 63 prefill nodes'
CLAIM_WAIT = 1.0  # seconds a prefill node waits for the decode node's step to end
POLL = 0.002  # seconds between a waiting prefill node's reads


def _open(path: str | Path) -> mmap.mmap:
    """The shared bytes, created zeroed by whichever node comes first."""
    # no symlink followed: the file sits in a directory every user may write
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        if os.fstat(fd).st_size < SLOTS:
            os.ftruncate(fd, SLOTS)
        return mmap.mmap(fd, SLOTS)
    finally:
        os.close(fd)


class LentCores:
    """The decode node's side; `before_step` and `after_step` run on its engine thread
    (torch's thread count is the calling thread's own setting)."""

    def __init__(self, path: str | Path, base: int, lend: int) -> None:
        if not 1 <= base <= lend:
            raise ValueError(f"lent cores: need 1 <= base ({base}) <= lend ({lend})")
        self.mem = _open(path)
        self.mem[0] = 0  # a restarted node's: its dead predecessor may have left it set
        self.base = base
        self.lend = lend
        self.lent_steps = 0  # steps run on the lent cores (a metric)
        self.steps = 0

    def _prefill_busy(self) -> bool:
        return any(self.mem[1:SLOTS])

    def before_step(self) -> int:
        """Choose this step's thread count and return it."""
        want = self.base
        if not self._prefill_busy():
            self.mem[0] = 1  # mark first, then look again (module docstring)
            if self._prefill_busy():
                self.mem[0] = 0
            else:
                want = self.lend
        if want != torch.get_num_threads():
            torch.set_num_threads(want)
        self.steps += 1
        self.lent_steps += want > self.base
        return want

    def after_step(self) -> None:
        self.mem[0] = 0

    def close(self) -> None:
        self.mem[0] = 0
        self.mem.close()


class CoreClaim:
    """A prefill node's side: `acquire` before the steps it computes, `release` after."""

    def __init__(self, path: str | Path, index: int) -> None:
        if not 0 <= index < SLOTS - 1:
            raise ValueError(f"core share slot {index}: at most {SLOTS - 1} prefill nodes")
        self.mem = _open(path)
        self.slot = 1 + index
        self.mem[self.slot] = 0  # a restarted node's: its dead predecessor may have left it
        self.waited = 0.0  # seconds spent waiting for the decode node, in all
        # The decode node's byte stayed set through a whole wait (it died, or hangs): the
        # next batches do not wait for it again until it is seen clear.
        self.stuck = False

    async def acquire(self) -> None:
        self.mem[self.slot] = 1
        if self.stuck and self.mem[0]:
            return
        self.stuck = False
        started = time.monotonic()
        deadline = started + CLAIM_WAIT
        # the decode node's step on the lent cores ends within one step; past the wait,
        # compute anyway (a hung or dead decode node must not stop prefills)
        while self.mem[0] and time.monotonic() < deadline:
            await asyncio.sleep(POLL)
        self.stuck = bool(self.mem[0])
        self.waited += time.monotonic() - started

    def release(self) -> None:
        self.mem[self.slot] = 0

    def close(self) -> None:
        self.mem[self.slot] = 0
        self.mem.close()
