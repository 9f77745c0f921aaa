"""A bounded LRU store of KV blocks by hash (first version: in memory only).

The byte limit is never exceeded: storing a block first evicts least recently used ones.
Slab arenas, pinning, a disk tier and per-block checksums on read come with the KV-cache
issue; this version already serves blocks by hash to any node over the data plane.
"""

from __future__ import annotations

from collections import OrderedDict


class BlockStore:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.blocks: OrderedDict[bytes, bytes] = OrderedDict()
        self.used_bytes = 0
        self.evictions = 0
        self.hits = 0
        self.misses = 0

    def put(self, block_hash: bytes, data: bytes) -> bool:
        """Store (or refresh) a block; False if it can never fit."""
        if len(data) > self.capacity_bytes:
            return False
        old = self.blocks.pop(block_hash, None)
        if old is not None:
            self.used_bytes -= len(old)
        while self.used_bytes + len(data) > self.capacity_bytes:
            _, evicted = self.blocks.popitem(last=False)
            self.used_bytes -= len(evicted)
            self.evictions += 1
        self.blocks[block_hash] = data
        self.used_bytes += len(data)
        return True

    def prefix(self, hashes: list[bytes]) -> list[bytes]:
        """The stored blocks of the longest stored prefix of `hashes` (marked recently used)."""
        out = []
        for h in hashes:
            data = self.blocks.get(h)
            if data is None:
                self.misses += 1
                break
            self.blocks.move_to_end(h)
            self.hits += 1
            out.append(data)
        return out
