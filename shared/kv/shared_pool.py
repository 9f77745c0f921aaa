"""One KV memory budget shared by the block pools of several models on one node.

A decode node hosting several models gives each model's engine a pool of its own (each
model's KV layout is its own: layers, heads, dtype, so its own block size in bytes), but
one budget of bytes for them all, so that the memory a model idles on serves the busy one.

Each pool spans the whole budget in block ids, over memory committed only as it is used
(`PagedKVCache(lazy=True)`: untouched pages cost nothing). A block id is *committed* once
the pool has used it: its pages are resident, and its bytes count against the budget
until the pool gives them back. A pool takes, in this order:
1. a fresh id while the budget has bytes to spare;
2. one of its own free committed blocks (least recently freed first, as `BlockPool` does:
   a cached prefix block is evicted);
3. a fresh id after the other pools gave back enough of their free committed blocks
   (least recently freed first; their pages are released, `on_release`).
So a pool's free blocks (`num_free`) are its own free committed ones plus what the budget
spares it, counting the others' free committed blocks, which it may reclaim: a model
busy while the other idles can use nearly the whole budget, and the idle model's free
memory comes back to it as soon as it needs it. Blocks in use are never taken.

Fairness between the models' *steps* is the engine thread's: one thread runs every
engine's calls in the order they were asked (a FIFO), and each model's worker asks for
its next step only after its last one, so two busy models step in turn.

Every call is made on the node's one engine thread (no locks: as `BlockPool`).
"""

from __future__ import annotations

from collections.abc import Callable

from shared.errors import CapacityError
from shared.kv.block_hash import BlockHash
from shared.kv.block_pool import BlockPool


class KVBudget:
    """Bytes of KV memory the pools registered on it commit, together, at most."""

    def __init__(self, total_bytes: int) -> None:
        if total_bytes <= 0:
            raise ValueError("a KV budget needs at least one byte")
        self.total = total_bytes
        self.committed = 0
        self.pools: list[SharedBlockPool] = []

    @property
    def spare(self) -> int:
        """Bytes no pool has committed."""
        return self.total - self.committed

    def reclaimable(self, asking: SharedBlockPool) -> int:
        """Bytes `asking` could commit now: the spare ones and the other pools' free
        committed blocks."""
        return self.spare + sum(p.free_committed_bytes for p in self.pools if p is not asking)

    def commit(self, asking: SharedBlockPool, nbytes: int) -> None:
        """Count `nbytes` more as committed by `asking`, first taking back the other pools'
        free committed blocks (least recently freed first, pool after pool) if needed."""
        for pool in self.pools:
            if self.spare >= nbytes:
                break
            if pool is not asking:
                pool.decommit(nbytes - self.spare)
        if self.spare < nbytes:
            raise CapacityError(f"KV budget: {nbytes} B asked, {self.spare} B to spare")
        self.committed += nbytes


class SharedBlockPool(BlockPool):
    """A `BlockPool` of one model's blocks whose memory comes from a `KVBudget`."""

    def __init__(
        self,
        budget: KVBudget,
        block_bytes: int,
        on_evict: Callable[[int, BlockHash], None] | None = None,
    ) -> None:
        super().__init__(max(1, budget.total // block_bytes), on_evict)
        self.budget = budget
        self.block_bytes = block_bytes
        # Free ids: the base class's queue holds the committed ones; `fresh` the others
        # (a stack: the lowest ids first, so the pages used stay few and together).
        self.fresh = list(range(self.num_blocks - 1, -1, -1))
        self.free_block_ids.clear()
        self.on_release: Callable[[int], None] | None = None  # pages of a given-back block
        budget.pools.append(self)

    @property
    def free_committed_bytes(self) -> int:
        return len(self.free_block_ids) * self.block_bytes

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out now: its own free committed ones, and as many
        fresh ones as the budget can give it (see the module docstring)."""
        room = self.budget.reclaimable(self) // self.block_bytes
        return len(self.free_block_ids) + min(len(self.fresh), room)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_block_ids) - len(self.fresh)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        if not self.can_allocate(n):
            raise CapacityError(f"need {n} KV blocks, {self.num_free} free")
        spare = min(n, len(self.fresh), self.budget.spare // self.block_bytes)
        ids = self._fresh(spare)
        own = min(n - len(ids), len(self.free_block_ids))
        ids += super().allocate(own) if own else []
        if len(ids) < n:
            ids += self._fresh(n - len(ids))
        return ids

    def _fresh(self, n: int) -> list[int]:
        if n <= 0:
            return []
        self.budget.commit(self, n * self.block_bytes)
        ids = [self.fresh.pop() for _ in range(n)]
        for block_id in ids:
            self.ref_counts[block_id] = 1
        return ids

    def decommit(self, nbytes: int) -> int:
        """Give back free committed blocks (least recently freed first, their cached
        hashes evicted, their pages released) until `nbytes` are back or none is left;
        the bytes given back."""
        given = 0
        while given < nbytes and self.free_block_ids:
            block_id, _ = self.free_block_ids.popitem(last=False)
            self._evict(block_id)
            if self.on_release is not None:
                self.on_release(block_id)
            self.fresh.append(block_id)
            given += self.block_bytes
        self.budget.committed -= given
        return given
