"""Block pool: allocation, free and eviction order asserted exactly."""

from __future__ import annotations

import pytest

from shared.errors import CapacityError
from shared.kv.block_hash import BlockHash
from shared.kv.block_pool import BlockPool

pytestmark = pytest.mark.unit


def h(n: int) -> BlockHash:
    return BlockHash(n.to_bytes(16, "little"))


def test_allocates_from_the_head_in_order() -> None:
    pool = BlockPool(6)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert pool.num_free == 1 and pool.num_used == 5


def test_check_then_act() -> None:
    pool = BlockPool(4)
    assert pool.can_allocate(4) and not pool.can_allocate(5)
    pool.allocate(3)
    assert not pool.can_allocate(2)
    with pytest.raises(CapacityError):
        pool.allocate(2)
    assert pool.num_free == 1  # a refused allocation takes nothing


def test_free_appends_in_reverse_so_tail_blocks_are_reused_first() -> None:
    pool = BlockPool(6)
    seq = pool.allocate(3)  # [0, 1, 2]
    pool.free(seq)
    # queue is now 3, 4, 5, then 2, 1, 0
    assert pool.allocate(6) == [3, 4, 5, 2, 1, 0]


def test_eviction_order_and_callback() -> None:
    evicted: list[tuple[int, BlockHash]] = []
    pool = BlockPool(4, on_evict=lambda b, bh: evicted.append((b, bh)))
    a = pool.allocate(2)
    for i, block in enumerate(a):
        pool.commit_hash(block, h(i))
    pool.free(a)
    assert pool.lookup(h(0)) == 0 and pool.lookup(h(1)) == 1  # still cached while free
    assert pool.allocate(2) == [2, 3]  # never-used blocks first: nothing evicted
    assert evicted == []
    assert pool.allocate(1) == [1]  # the sequence's last block goes first
    assert evicted == [(1, h(1))]
    assert pool.lookup(h(1)) is None and pool.lookup(h(0)) == 0


def test_share_takes_cached_block_out_of_free_queue() -> None:
    pool = BlockPool(3)
    [b] = pool.allocate(1)
    pool.commit_hash(b, h(7))
    pool.free([b])
    assert pool.num_free == 3
    pool.share([b])
    assert pool.ref_counts[b] == 1 and pool.num_free == 2
    assert pool.allocate(2) == [1, 2]
    assert pool.lookup(h(7)) == b  # shared block was not evicted


def test_refcount_keeps_shared_block_until_last_free() -> None:
    pool = BlockPool(2)
    [b] = pool.allocate(1)
    pool.share([b])
    pool.free([b])
    assert pool.num_free == 1
    pool.free([b])
    assert pool.num_free == 2
    with pytest.raises(ValueError):
        pool.free([b])


def test_duplicate_hash_keeps_first_owner() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.commit_hash(a, h(1))
    pool.commit_hash(b, h(1))
    assert pool.lookup(h(1)) == a
    assert pool.block_hash[b] is None
