"""A bounded pool of KV block ids with reference counts and a cache of hashed blocks.

Check-then-act: `can_allocate(n)` before `allocate(n)`, which raises if it would not fit.
Freed blocks keep their contents and hash: they stay findable by `lookup` until the pool
needs them again, so a later request with the same prefix can reuse them. The free queue
orders reuse: `allocate` takes from its head (least recently freed first, evicting whatever
hash that block held), `free` appends to its tail in *reverse* block order so a sequence's
last blocks, the least likely to be shared, are evicted before its first ones. An
OrderedDict gives O(1) append, pop-from-head and removal from the middle (a cache hit on a
free block takes it out of the queue).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from shared.errors import CapacityError
from shared.kv.block_hash import BlockHash


class BlockPool:
    """Block ids 0..num_blocks-1, reference counted, with an LRU of free-but-cached blocks."""

    def __init__(
        self, num_blocks: int, on_evict: Callable[[int, BlockHash], None] | None = None
    ) -> None:
        if num_blocks <= 0:
            raise ValueError("a block pool needs at least one block")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.hash_to_block_id: dict[BlockHash, int] = {}
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.on_evict = on_evict

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out now (free, cached or not)."""
        return len(self.free_block_ids)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self.free_block_ids)

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks from the head of the free queue, evicting any hash they held."""
        if not self.can_allocate(n):
            raise CapacityError(f"need {n} KV blocks, {len(self.free_block_ids)} free")
        ids: list[int] = []
        for _ in range(n):
            block_id, _ = self.free_block_ids.popitem(last=False)
            self._evict(block_id)
            self.ref_counts[block_id] = 1
            ids.append(block_id)
        return ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; blocks reaching zero join the queue's tail."""
        for block_id in reversed(list(block_ids)):
            if self.ref_counts[block_id] <= 0:
                raise ValueError(f"block {block_id} freed more often than allocated")
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_block_ids[block_id] = None

    def commit_hash(self, block_id: int, block_hash: BlockHash) -> None:
        """Name a full, in-use block by its chained hash so later prefixes can find it."""
        if self.block_hash[block_id] is not None or block_hash in self.hash_to_block_id:
            return  # already named, or another block holds the same content
        self.block_hash[block_id] = block_hash
        self.hash_to_block_id[block_hash] = block_id

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self.hash_to_block_id.get(block_hash)

    def cached_prefix(self, hashes: Iterable[BlockHash]) -> list[int]:
        """Block ids holding the longest run of leading `hashes` (stops at the first miss)."""
        hits: list[int] = []
        for h in hashes:
            block_id = self.hash_to_block_id.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def share(self, block_ids: Iterable[int]) -> None:
        """Add a reference to cached blocks (a prefix hit), taking free ones out of the queue."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self.free_block_ids[block_id]
            self.ref_counts[block_id] += 1

    def _evict(self, block_id: int) -> None:
        old = self.block_hash[block_id]
        if old is None:
            return
        self.block_hash[block_id] = None
        del self.hash_to_block_id[old]
        if self.on_evict is not None:
            self.on_evict(block_id, old)
