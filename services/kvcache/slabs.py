"""A slab arena: one preallocated buffer cut into equal slabs, handed out by index.

Every KV block of one model has the same size, so a block store needs no general allocator:
a free list of slab indices per block size gives O(1) allocation and free, no per-block
malloc and no fragmentation. The buffer is an anonymous memory map (memory tier) or a
memory-mapped file (disk tier); either way its size is fixed at creation, so an arena can
never hold more bytes than it was given.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from pathlib import Path

from shared.buffers import PAGE, release_pages

# Fault pages in, writable, without changing what they hold (Linux 5.14+; Python's mmap
# module names it from 3.13 on).
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


class SlabArena:
    """`num_slabs` slabs of `slab_bytes` each, in memory or in a file under `path`."""

    def __init__(self, slab_bytes: int, num_slabs: int, path: Path | None = None) -> None:
        if slab_bytes <= 0 or num_slabs < 0:
            raise ValueError("a slab arena needs a positive slab size and slab count")
        self.slab_bytes = slab_bytes
        self.num_slabs = num_slabs
        self.path = path
        size = max(1, slab_bytes * num_slabs)  # mmap refuses length 0
        self._fd: int | None = None
        self.out_of_space = 0  # slabs refused because the file system had no room
        if path is None:
            self._map = mmap.mmap(-1, size)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, size)  # sparse: disk is used only as slabs are written
                self._map = mmap.mmap(fd, size)
            except BaseException:
                os.close(fd)
                raise
            self._fd = fd  # kept: each slab's blocks are reserved as it is handed out
        self._view = memoryview(self._map)
        # A stack: the most recently freed slab is reused first (its pages are warm). Slabs
        # never used come off it in index order, so those below `fresh` have all been used.
        self._free = list(range(num_slabs - 1, -1, -1))
        self.fresh = 0
        self.prefaulted = 0  # bytes from the map's start faulted in by `prefault`

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def used_bytes(self) -> int:
        return (self.num_slabs - len(self._free)) * self.slab_bytes

    def alloc(self) -> int | None:
        """A free slab's index, or None when the arena is full (or, for a file, when the
        file system has no room for the slab's blocks).

        A file's slab has its disk blocks reserved first: writing through the map into a
        hole the file system cannot fill raises SIGBUS, which would kill the node; a
        refused reservation is just a full disk tier (the store evicts or drops)."""
        if not self._free:
            return None
        slab = self._free.pop()
        if self._fd is not None:
            try:
                os.posix_fallocate(self._fd, slab * self.slab_bytes, self.slab_bytes)
            except OSError:  # ENOSPC (or a quota): no room on the disk for it now
                self._free.append(slab)
                self.out_of_space += 1
                return None
        self.fresh = max(self.fresh, slab + 1)
        return slab

    def free(self, slab: int) -> None:
        self._free.append(slab)

    def release(self, slab: int) -> None:
        """Hand the pages wholly inside a free slab back to the system (memory, or the disk
        blocks under a file): the slab reads as zeros until written again. Used when a
        block of another size takes its room, so the tier's bytes stay within its limit."""
        lo = slab * self.slab_bytes
        # MADV_REMOVE frees shared memory and file blocks alike (DONTNEED would keep a
        # shared mapping's pages); a file system without hole punching keeps them.
        with contextlib.suppress(OSError):
            release_pages(self._map, lo, lo + self.slab_bytes, mmap.MADV_REMOVE)

    def ahead_bytes(self) -> int:
        """Bytes faulted in by `prefault` that no slab handed out so far covers."""
        return max(0, self.prefaulted - self.fresh * self.slab_bytes)

    def touched_bytes(self) -> int:
        """The extent whose pages may be resident: every slab handed out at least once (a
        freed one keeps its pages until `release`) and what is faulted in ahead."""
        return max(self.prefaulted, self.fresh * self.slab_bytes)

    def prefault(self, nbytes: int) -> int:
        """Fault in up to `nbytes` of the pages of the slabs never used yet, in the order
        they will be handed out, so the puts that fill them copy at memory speed instead
        of faulting in every page (services/kvcache/prefault.py says why). Their contents
        do not change. Memory arenas only (0 for a file). Returns the bytes faulted in;
        raises OSError where the system cannot (Linux before 5.14)."""
        if self.path is not None:
            return 0
        start = max(self.prefaulted, self.fresh * self.slab_bytes) // PAGE * PAGE
        end = min(start + nbytes, self.slab_bytes * self.num_slabs)
        if end <= start:
            return 0
        self._map.madvise(MADV_POPULATE_WRITE, start, end - start)
        self.prefaulted = end
        return end - start

    def view(self, slab: int) -> memoryview:
        """The slab's bytes (writable; valid until the slab is freed and reused)."""
        start = slab * self.slab_bytes
        return self._view[start : start + self.slab_bytes]

    def close(self) -> None:
        self._view.release()
        self._map.close()
        if self.path is not None:
            self.path.unlink(missing_ok=True)
