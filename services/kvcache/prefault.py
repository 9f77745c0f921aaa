"""Faulting the memory tier's pages in ahead of the puts that will fill them.

A memory arena is an anonymous map: its pages cost nothing until first written, and then
each 4 KiB page faults and is zeroed inside the put that writes it. On a fresh node every
put paid that: a 737 KB block took 0.40 ms to store into never-used slabs against 0.15 ms
into slabs used before (benchmarks/kvcache_put.py), and py-spy found half of the node's
busy time in that copy while a wave of prompts was stored, beside the decode node's steps
(docs/benchmarks-log.md, "Where the split's ITL tail at 16 streams comes from"). A background
task now faults the next slabs in, a few MB at a time between the node's other work, so
the bursts find them ready.

It stays within the memory tier's limit: it faults in only while the extents every class
has touched (slabs used at least once, which keep their pages when freed, and what is
faulted in ahead) fit in the limit, and never more than `AHEAD_BYTES` ahead of a class's
use. The class the latest put went to is the one kept ahead (one model's layout, usually
the only one).
"""

from __future__ import annotations

import asyncio
import logging

from services.kvcache.store import MEMORY, BlockStore

log = logging.getLogger("tandem.kvcache.prefault")

AHEAD_BYTES = 128 << 20  # a few waves of prompts' blocks; bounded by the tier's room too
STEP_BYTES = 4 << 20  # one round's work: ~1 ms of the event loop here
BUSY_PAUSE = 0.005  # seconds between rounds while catching up
IDLE_PAUSE = 0.05  # and while nothing is left to do


def prefault_step(store: BlockStore, nbytes: int = STEP_BYTES) -> int:
    """Fault in up to `nbytes` ahead of the latest put's class, within the tier's limit;
    the bytes faulted in (0: nothing to do). Raises OSError where the system cannot."""
    arenas = store.classes.get(store.last_size)
    if arenas is None:
        return 0
    arena = arenas[MEMORY]
    room = store.memory_bytes - sum(a[MEMORY].touched_bytes() for a in store.classes.values())
    n = min(nbytes, room, AHEAD_BYTES - arena.ahead_bytes())
    return arena.prefault(n) if n > 0 else 0


async def keep_faulted_in(store: BlockStore) -> None:
    """Run until cancelled: fault the memory tier in ahead of its puts."""
    while True:
        try:
            done = prefault_step(store)
        except OSError as exc:  # an older kernel: puts fault their own pages, as before
            log.info("memory tier not faulted in ahead of use: %s", exc)
            return
        await asyncio.sleep(BUSY_PAUSE if done else IDLE_PAUSE)
