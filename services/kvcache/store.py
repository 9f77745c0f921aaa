"""A two-tier KV block store by hash: memory slabs, spilling to a disk arena, LRU, pins, checksums.

- Blocks come in size classes, one per KV layout (each model has its own; a hash names one
  model's block, so one hash has one size). Each class has a `SlabArena` per tier whose
  slab is one block; the tier's byte limit is shared by the classes: a class's arena spans
  the whole limit in address space (unused pages cost nothing), and the bytes of all the
  classes' blocks together never pass the limit. A block evicted or demoted to make room
  for a block of another size has its pages handed back (`SlabArena.release`), so memory
  and disk in use stay within the limits however the models' shares move.
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


MAX_SIZE_CLASSES = 16  # block sizes (KV layouts, about one per model) a store keeps apart


class BlockSizeError(ValueError):
    """A block size the store cannot take (not positive, or one size class too many)."""


@dataclass
class _Entry:
    tier: int
    slab: int
    checksum: int
    size: int  # its block's bytes: its size class
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
        self.used = [0, 0]  # bytes of stored blocks, by tier
        self.pinned_bytes = 0
        self.classes: dict[int, tuple[SlabArena, SlabArena]] = {}  # size → (memory, disk)
        self.entries: dict[bytes, _Entry] = {}
        self.lru: tuple[OrderedDict[bytes, None], OrderedDict[bytes, None]] = (
            OrderedDict(),
            OrderedDict(),
        )
        self.pins: dict[bytes, int] = {}
        self.stats = StoreStats()
        self.last_size = 0  # the size class of the latest put (the one to fault in ahead)

    # ---- set-up ----------------------------------------------------------------------------

    def size_class(self, block_bytes: int) -> tuple[SlabArena, SlabArena]:
        """The arenas (memory, disk) of blocks of `block_bytes`, made on its first put."""
        arenas = self.classes.get(block_bytes)
        if arenas is not None:
            return arenas
        if block_bytes <= 0:
            raise BlockSizeError("a block needs at least one byte")
        if len(self.classes) >= MAX_SIZE_CLASSES:
            self._retire_empty_classes()
        if len(self.classes) >= MAX_SIZE_CLASSES:
            raise BlockSizeError(
                f"this store keeps at most {MAX_SIZE_CLASSES} block sizes holding blocks"
            )
        memory = SlabArena(block_bytes, self.memory_bytes // block_bytes)
        disk_slabs = self.disk_bytes // block_bytes
        disk_path = None
        if self.disk_dir is not None and disk_slabs:
            disk_path = self.disk_dir / f"blocks-{block_bytes}.arena"
        disk = SlabArena(block_bytes, disk_slabs, disk_path)
        self.classes[block_bytes] = arenas = (memory, disk)
        log.info(
            "block store: a class of %d B blocks, at most %d in memory, %d on disk",
            block_bytes,
            memory.num_slabs,
            disk_slabs,
        )
        return arenas

    def _retire_empty_classes(self) -> None:
        """Close the arenas of the classes that hold no block (their models gone, their
        blocks evicted), so a long-lived node keeps taking new models' layouts. A class
        whose memory is still lent out (a reply being sent from it) stays."""
        for size, arenas in list(self.classes.items()):
            if any(a.num_free != a.num_slabs for a in arenas):
                continue
            try:
                for arena in arenas:
                    arena.close()
            except BufferError:  # a view of it is still in use: keep it for now
                continue
            del self.classes[size]
            log.info("block store: the class of %d B blocks is empty: closed", size)

    def close(self) -> None:
        for arenas in self.classes.values():
            for arena in arenas:
                arena.close()
        self.classes.clear()
        self.entries.clear()
        self.used = [0, 0]
        self.pinned_bytes = 0

    # ---- queries ---------------------------------------------------------------------------

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def used_bytes(self, tier: int | None = None) -> int:
        return sum(self.used) if tier is None else self.used[tier]

    @property
    def limits(self) -> tuple[int, int]:
        """Each tier's byte limit (memory, disk)."""
        return self.memory_bytes, self.disk_bytes

    def block_size(self, block_hash: bytes) -> int:
        """The stored block's bytes, or 0 if it is not stored."""
        entry = self.entries.get(block_hash)
        return entry.size if entry is not None else 0

    def arena(self, entry: _Entry) -> SlabArena:
        return self.classes[entry.size][entry.tier]

    # ---- writes ----------------------------------------------------------------------------

    def put(self, block_hash: bytes, data: bytes | memoryview, producer: str = "") -> bool:
        """Store a block (a known hash is only marked recently used), noting which node
        stored it. False if not stored."""
        size = len(data)
        self.size_class(size)
        self.last_size = size
        if block_hash in self.entries:
            self._touch(block_hash)
            return True
        slab = self._free_slab(size, MEMORY)
        tier = MEMORY
        if slab is None:  # every memory slab pinned: go straight to disk if there is one
            slab, tier = self._free_slab(size, DISK), DISK
            if slab is None:
                self.stats.rejected += 1
                return False
        entry = _Entry(tier, slab, checksum(data), size, producer)
        self.arena(entry).view(slab)[:] = data
        self.entries[block_hash] = entry
        self.lru[tier][block_hash] = None
        self.stats.stored += 1
        return True

    def pin(self, hashes: Iterable[bytes]) -> int:
        """Protect stored blocks from eviction (counted: pin twice, unpin twice)."""
        n = 0
        for h in hashes:
            entry = self.entries.get(h)
            if entry is not None:
                count = self.pins.get(h, 0)
                self.pins[h] = count + 1
                self.pinned_bytes += 0 if count else entry.size
                n += 1
        return n

    def unpin(self, hashes: Iterable[bytes]) -> None:
        for h in hashes:
            count = self.pins.get(h, 0) - 1
            if count > 0:
                self.pins[h] = count
            elif self.pins.pop(h, None) is not None:
                self.pinned_bytes -= self.entries[h].size

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
        self._free(entry)
        if self.pins.pop(block_hash, None) is not None:
            self.pinned_bytes -= entry.size
        return True

    # ---- reads -----------------------------------------------------------------------------

    def get(self, block_hash: bytes) -> bytes | None:
        """A verified copy of the block (promoted to memory if it was on disk), or None."""
        data = self._read(block_hash)
        return None if data is None else bytes(data)

    def prefix_payload(self, hashes: Sequence[bytes]) -> tuple[memoryview, list[int], int]:
        """The longest stored prefix of `hashes` as one buffer, block after block, each
        verified and copied once, with each block's checksum (a transfer's chunk checksums,
        so the sender does not hash the payload again) and the blocks' size."""
        size = self.block_size(hashes[0]) if hashes else 0
        n = 0
        while n < len(hashes) and self.block_size(hashes[n]) == size != 0:
            n += 1
        if n < len(hashes):
            self.stats.misses += 1  # the first block not stored, as a get would count it
        out = uninitialised(n * size)  # cut below to the blocks copied in
        sums: list[int] = []
        for i, h in enumerate(hashes[:n]):
            data = self._read(h)
            if data is None:  # corrupt: dropped, and the prefix ends here
                break
            out[i * size : (i + 1) * size] = data
            sums.append(self.entries[h].checksum)
        return out[: len(sums) * size], sums, size if sums else 0

    # ---- internals -------------------------------------------------------------------------

    def _read(self, block_hash: bytes) -> memoryview | bytes | None:
        """The verified block, or None (a miss; a corrupt block is dropped). A memory-tier
        block comes as a view of its slab (valid until the store changes); a disk-tier one
        as a copy, promoted to memory."""
        entry = self.entries.get(block_hash)
        if entry is None:
            self.stats.misses += 1
            return None
        data: memoryview | bytes = self.arena(entry).view(entry.slab)
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
        self._free(entry)
        del self.lru[DISK][block_hash]
        slab = self._free_slab(entry.size, MEMORY)
        if slab is None:  # memory all pinned: the block stays on disk
            slab = self._free_slab(entry.size, DISK)
            if slab is None:  # its room went to a block demoted meanwhile: dropped
                del self.entries[block_hash]
                if self.pins.pop(block_hash, None) is not None:
                    self.pinned_bytes -= entry.size
                self.stats.evicted += 1
                self._evicted([block_hash])
                return
            entry.slab = slab
            self.arena(entry).view(slab)[:] = data
            self.lru[DISK][block_hash] = None
            return
        entry.tier, entry.slab = MEMORY, slab
        self.arena(entry).view(slab)[:] = data
        self.lru[MEMORY][block_hash] = None
        self.stats.promoted += 1

    def _victim(self, tier: int) -> bytes | None:
        """The least recently used unpinned block of a tier."""
        for h in self.lru[tier]:
            if h not in self.pins:
                return h
        return None

    def _free(self, entry: _Entry) -> None:
        """Give its slab back to its arena and its bytes to its tier."""
        self.arena(entry).free(entry.slab)
        self.used[entry.tier] -= entry.size

    def _free_slab(self, size: int, tier: int) -> int | None:
        """A free slab for a block of `size` in `tier`, making room by demotion or eviction
        (of any class's least recently used block) if needed."""
        arena = self.classes[size][tier]
        if not arena.num_slabs:
            return None
        while self.used[tier] + size > self.limits[tier]:
            victim = self._victim(tier)
            if victim is None:
                return None
            entry = self.entries[victim]
            arena_of, slab_of = self.arena(entry), entry.slab
            self._make_room(victim, entry, tier)
            if entry.size != size:  # its slab will not take this block: its pages go back
                arena_of.release(slab_of)
        slab = arena.alloc()
        if slab is None:  # within the tier's limit, so only a disk out of space says no
            return None
        self.used[tier] += size
        return slab

    def _make_room(self, victim: bytes, entry: _Entry, tier: int) -> None:
        """Move `victim` out of `tier`: a memory block to disk when it is intact and the
        disk takes it, else out of the store."""
        data = self.arena(entry).view(entry.slab)
        intact = checksum(data) == entry.checksum
        if not intact:  # never spill a block that went bad: it could only be served wrong
            self.stats.corrupt += 1
        disk = self.classes[entry.size][DISK]
        if tier == MEMORY and intact and disk.num_slabs:
            disk_slab = self._free_slab(entry.size, DISK)
            if disk_slab is not None:
                disk.view(disk_slab)[:] = data
                del self.lru[MEMORY][victim]
                self._free(entry)
                entry.tier, entry.slab = DISK, disk_slab
                self.lru[DISK][victim] = None
                self.stats.spilled += 1
                return
        self.remove(victim)
        self.stats.evicted += 1
        self._evicted([victim])

    def _evicted(self, hashes: list[bytes]) -> None:
        if self.on_evict is not None:
            self.on_evict(hashes)
