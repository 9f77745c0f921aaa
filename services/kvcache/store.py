"""A two-tier KV block store by hash: memory slabs, spilling to a disk arena, LRU, pins, checksums.

- Each tier is a `SlabArena` whose slab is one KV block (the size the first put brings;
  every later block must match), so neither tier can exceed its byte limit.
- Memory is the hot tier. Storing into a full memory tier demotes its least recently used
  unpinned block to disk (or drops it when there is no disk tier); a full disk tier drops
  its own least recently used unpinned block. A hit on disk promotes the block back.
- Every block carries an xxh3-64 checksum taken when it was stored and verified whenever it
  is read or moved: a block that no longer matches is dropped and counted as a miss, never
  served.
- Pinned blocks (in use by someone who must not lose them, such as an in-flight request's
  checkpoint) are never evicted or demoted.

Single-threaded by design: the kvcache node calls it from its event loop only.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import xxhash

from services.kvcache.slabs import SlabArena
from shared.buffers import uninitialised

log = logging.getLogger("tandem.kvcache.store")

MEMORY, DISK = 0, 1
TIER_NAMES = ("memory", "disk")


class BlockSizeError(ValueError):
    """A block whose size differs from the store's block size."""


@dataclass
class _Entry:
    tier: int
    slab: int
    checksum: int
    producer: str = ""  # the node that stored it first (provenance: purge by node)


@dataclass
class StoreStats:
    stored: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    spilled: int = 0  # memory → disk
    promoted: int = 0  # disk → memory
    evicted: int = 0  # dropped from the store altogether
    rejected: int = 0  # puts that could not be stored (every slab pinned)


def checksum(data: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data)


class BlockStore:
    """Blocks by hash in a memory tier and an optional disk tier, each with a byte limit."""

    def __init__(
        self,
        memory_bytes: int,
        disk_bytes: int = 0,
        disk_dir: Path | None = None,
        on_evict: Callable[[list[bytes]], None] | None = None,
    ) -> None:
        if disk_bytes and disk_dir is None:
            raise ValueError("a disk tier needs a directory")
        self.memory_bytes = memory_bytes
        self.disk_bytes = disk_bytes
        self.disk_dir = disk_dir
        self.on_evict = on_evict
        self.block_bytes = 0
        self.arenas: tuple[SlabArena, ...] = ()
        self.entries: dict[bytes, _Entry] = {}
        self.lru: tuple[OrderedDict[bytes, None], OrderedDict[bytes, None]] = (
            OrderedDict(),
            OrderedDict(),
        )
        self.pins: dict[bytes, int] = {}
        self.stats = StoreStats()

    # ---- set-up ----------------------------------------------------------------------------

    def configure(self, block_bytes: int) -> None:
        """Fix the block size (done by the first put); later blocks must have the same."""
        if self.block_bytes:
            if block_bytes != self.block_bytes:
                raise BlockSizeError(f"blocks here are {self.block_bytes} bytes, not {block_bytes}")
            return
        if block_bytes <= 0:
            raise BlockSizeError("a block needs at least one byte")
        memory = SlabArena(block_bytes, self.memory_bytes // block_bytes)
        disk_slabs = self.disk_bytes // block_bytes
        disk_path = (self.disk_dir / "blocks.arena") if self.disk_dir is not None else None
        disk = SlabArena(block_bytes, disk_slabs, disk_path if disk_slabs else None)
        self.block_bytes = block_bytes
        self.arenas = (memory, disk)
        log.info(
            "block store: %d B blocks, %d in memory, %d on disk",
            block_bytes,
            memory.num_slabs,
            disk_slabs,
        )

    def close(self) -> None:
        for arena in self.arenas:
            arena.close()
        self.arenas = ()
        self.entries.clear()

    # ---- queries ---------------------------------------------------------------------------

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def used_bytes(self, tier: int | None = None) -> int:
        if not self.arenas:
            return 0
        if tier is None:
            return sum(a.used_bytes for a in self.arenas)
        return self.arenas[tier].used_bytes

    # ---- writes ----------------------------------------------------------------------------

    def put(self, block_hash: bytes, data: bytes | memoryview, producer: str = "") -> bool:
        """Store a block (a known hash is only marked recently used), noting which node
        stored it. False if not stored."""
        self.configure(len(data))
        if block_hash in self.entries:
            self._touch(block_hash)
            return True
        slab = self._free_slab(MEMORY)
        tier = MEMORY
        if slab is None:  # every memory slab pinned: go straight to disk if there is one
            slab, tier = self._free_slab(DISK), DISK
            if slab is None:
                self.stats.rejected += 1
                return False
        self.arenas[tier].view(slab)[:] = data
        self.entries[block_hash] = _Entry(tier, slab, checksum(data), producer)
        self.lru[tier][block_hash] = None
        self.stats.stored += 1
        return True

    def pin(self, hashes: Iterable[bytes]) -> int:
        """Protect stored blocks from eviction (counted: pin twice, unpin twice)."""
        n = 0
        for h in hashes:
            if h in self.entries:
                self.pins[h] = self.pins.get(h, 0) + 1
                n += 1
        return n

    def unpin(self, hashes: Iterable[bytes]) -> None:
        for h in hashes:
            count = self.pins.get(h, 0) - 1
            if count > 0:
                self.pins[h] = count
            else:
                self.pins.pop(h, None)

    def purge(self, producer: str) -> list[bytes]:
        """Drop every block `producer` stored (pinned ones too: a bad block must not be
        served to a failover either); their hashes."""
        gone = [h for h, e in self.entries.items() if e.producer == producer]
        for h in gone:
            self.remove(h)
        self.stats.evicted += len(gone)
        return gone

    def remove(self, block_hash: bytes) -> bool:
        entry = self.entries.pop(block_hash, None)
        if entry is None:
            return False
        del self.lru[entry.tier][block_hash]
        self.arenas[entry.tier].free(entry.slab)
        self.pins.pop(block_hash, None)
        return True

    # ---- reads -----------------------------------------------------------------------------

    def get(self, block_hash: bytes) -> bytes | None:
        """A verified copy of the block (promoted to memory if it was on disk), or None."""
        data = self._read(block_hash)
        return None if data is None else bytes(data)

    def prefix_payload(self, hashes: Sequence[bytes]) -> tuple[memoryview, list[int]]:
        """The longest stored prefix of `hashes` as one buffer, block after block, each
        verified and copied once, with each block's checksum (a transfer's chunk checksums,
        so the sender does not hash the payload again)."""
        n = 0
        while n < len(hashes) and hashes[n] in self.entries:
            n += 1
        if n < len(hashes):
            self.stats.misses += 1  # the first block not stored, as a get would count it
        size = self.block_bytes
        out = uninitialised(n * size)  # cut below to the blocks copied in
        sums: list[int] = []
        for i, h in enumerate(hashes[:n]):
            data = self._read(h)
            if data is None:  # corrupt: dropped, and the prefix ends here
                break
            out[i * size : (i + 1) * size] = data
            sums.append(self.entries[h].checksum)
        return out[: len(sums) * size], sums

    # ---- internals -------------------------------------------------------------------------

    def _read(self, block_hash: bytes) -> memoryview | bytes | None:
        """The verified block, or None (a miss; a corrupt block is dropped). A memory-tier
        block comes as a view of its slab (valid until the store changes); a disk-tier one
        as a copy, promoted to memory."""
        entry = self.entries.get(block_hash)
        if entry is None:
            self.stats.misses += 1
            return None
        data: memoryview | bytes = self.arenas[entry.tier].view(entry.slab)
        if entry.tier == DISK:
            data = bytes(data)  # its slab is freed by the promotion
        if checksum(data) != entry.checksum:
            self.stats.corrupt += 1
            self.stats.misses += 1
            log.warning(
                "corrupt block %s in the %s tier: dropped",
                block_hash.hex(),
                TIER_NAMES[entry.tier],
            )
            self.remove(block_hash)
            self._evicted([block_hash])
            return None
        self.stats.hits += 1
        if entry.tier == DISK:
            assert isinstance(data, bytes)
            self._promote(block_hash, entry, data)
        else:
            self._touch(block_hash)
        return data

    def _touch(self, block_hash: bytes) -> None:
        self.lru[self.entries[block_hash].tier].move_to_end(block_hash)

    def _promote(self, block_hash: bytes, entry: _Entry, data: bytes) -> None:
        # Leave the disk slab first: demoting a memory block to make room may need it.
        self.arenas[DISK].free(entry.slab)
        del self.lru[DISK][block_hash]
        slab = self._free_slab(MEMORY)
        if slab is None:  # memory all pinned: the block stays on disk
            slab = self.arenas[DISK].alloc()
            assert slab is not None  # the slab just freed
            self.arenas[DISK].view(slab)[:] = data
            entry.slab = slab
            self.lru[DISK][block_hash] = None
            return
        self.arenas[MEMORY].view(slab)[:] = data
        entry.tier, entry.slab = MEMORY, slab
        self.lru[MEMORY][block_hash] = None
        self.stats.promoted += 1

    def _victim(self, tier: int) -> bytes | None:
        """The least recently used unpinned block of a tier."""
        for h in self.lru[tier]:
            if h not in self.pins:
                return h
        return None

    def _free_slab(self, tier: int) -> int | None:
        """A free slab of `tier`, making room by demotion or eviction if needed."""
        if not self.arenas[tier].num_slabs:
            return None
        slab = self.arenas[tier].alloc()
        if slab is not None:
            return slab
        victim = self._victim(tier)
        if victim is None:
            return None
        entry = self.entries[victim]
        data = self.arenas[tier].view(entry.slab)
        intact = checksum(data) == entry.checksum
        if not intact:  # never spill a block that went bad: it could only be served wrong
            self.stats.corrupt += 1
        if tier == MEMORY and intact and self.arenas[DISK].num_slabs:
            disk_slab = self._free_slab(DISK)
            if disk_slab is not None:
                self.arenas[DISK].view(disk_slab)[:] = data
                del self.lru[MEMORY][victim]
                self.arenas[MEMORY].free(entry.slab)
                entry.tier, entry.slab = DISK, disk_slab
                self.lru[DISK][victim] = None
                self.stats.spilled += 1
                return self.arenas[MEMORY].alloc()
        self.remove(victim)
        self.stats.evicted += 1
        self._evicted([victim])
        return self.arenas[tier].alloc()

    def _evicted(self, hashes: list[bytes]) -> None:
        if self.on_evict is not None:
            self.on_evict(hashes)
