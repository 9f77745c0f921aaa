"""kvcache's tiered store: slabs, exact LRU order, pins, spill and promotion, limits, checksums."""

from __future__ import annotations

from pathlib import Path

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from services.kvcache.slabs import SlabArena
from services.kvcache.store import DISK, MEMORY, BlockSizeError, BlockStore

pytestmark = pytest.mark.unit

B = 64  # block bytes in these tests


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def block(i: int) -> bytes:
    return bytes([i % 256]) * B


def test_slab_arena_allocates_every_slab_once_and_reuses_freed_ones(tmp_path: Path) -> None:
    for path in (None, tmp_path / "arena"):
        arena = SlabArena(B, 4, path)
        slabs = [arena.alloc() for _ in range(4)]
        assert sorted(s for s in slabs if s is not None) == [0, 1, 2, 3]
        assert arena.alloc() is None and arena.used_bytes == 4 * B
        arena.view(2)[:] = block(7)
        assert bytes(arena.view(2)) == block(7)
        arena.free(2)
        assert arena.num_free == 1 and arena.alloc() == 2
        arena.close()
    assert not (tmp_path / "arena").exists()


def test_lru_order_is_exact_and_prefix_stops_at_first_miss() -> None:
    store = BlockStore(memory_bytes=3 * B)
    for i in range(3):
        assert store.put(h(i), block(i))
    assert list(store.lru[MEMORY]) == [h(0), h(1), h(2)]
    assert bytes(store.prefix_payload([h(0)])[0]) == block(0)  # 0: now most recently used
    assert list(store.lru[MEMORY]) == [h(1), h(2), h(0)]
    assert store.put(h(3), block(3))  # evicts the least recently used: 1
    assert list(store.lru[MEMORY]) == [h(2), h(0), h(3)]
    assert store.stats.evicted == 1
    assert bytes(store.prefix_payload([h(0), h(1), h(2)])[0]) == block(0)
    assert store.put(h(2), block(2))  # re-storing a known block only refreshes it
    assert list(store.lru[MEMORY]) == [h(3), h(0), h(2)]  # the prefix lookup touched 0


def test_pinned_blocks_are_never_evicted() -> None:
    evicted: list[bytes] = []
    store = BlockStore(memory_bytes=2 * B, on_evict=evicted.extend)
    store.put(h(0), block(0))
    store.put(h(1), block(1))
    assert store.pin([h(0), h(9)]) == 1  # an unknown hash cannot be pinned
    store.put(h(2), block(2))  # 0 is older but pinned: 1 goes
    assert evicted == [h(1)] and h(0) in store
    store.pin([h(2)])
    assert not store.put(h(3), block(3))  # everything pinned: refused, nothing lost
    assert store.stats.rejected == 1 and h(0) in store and h(2) in store
    store.unpin([h(0)])
    assert store.put(h(3), block(3))
    assert evicted == [h(1), h(0)]


def test_spill_to_disk_and_promote_back(tmp_path: Path) -> None:
    store = BlockStore(memory_bytes=2 * B, disk_bytes=2 * B, disk_dir=tmp_path)
    for i in range(4):
        store.put(h(i), block(i))
    assert list(store.lru[MEMORY]) == [h(2), h(3)]
    assert list(store.lru[DISK]) == [h(0), h(1)]
    assert store.stats.spilled == 2 and store.stats.evicted == 0
    assert store.get(h(0)) == block(0)  # promoted; memory's LRU block (2) spills
    assert store.entries[h(0)].tier == MEMORY and store.entries[h(2)].tier == DISK
    assert list(store.lru[DISK]) == [h(1), h(2)]
    assert store.stats.promoted == 1
    store.put(h(4), block(4))  # memory full → 3 spills → disk full → 1 (disk LRU) dropped
    assert h(1) not in store and store.entries[h(3)].tier == DISK
    assert store.used_bytes(MEMORY) == 2 * B and store.used_bytes(DISK) == 2 * B
    assert (tmp_path / "blocks.arena").stat().st_size == 2 * B
    store.close()


@pytest.mark.parametrize("tier", [MEMORY, DISK])
def test_a_corrupted_block_is_a_miss_and_never_served(tmp_path: Path, tier: int) -> None:
    evicted: list[bytes] = []
    store = BlockStore(memory_bytes=B, disk_bytes=B, disk_dir=tmp_path, on_evict=evicted.extend)
    store.put(h(0), block(0))
    store.put(h(1), block(1))  # 0 spills to disk
    victim = h(0) if tier == DISK else h(1)
    entry = store.entries[victim]
    store.arenas[tier].view(entry.slab)[5] ^= 0xFF  # one flipped byte
    assert store.get(victim) is None
    assert store.stats.corrupt == 1 and victim not in store and evicted == [victim]
    other = h(1) if tier == DISK else h(0)
    assert store.get(other) == (block(1) if tier == DISK else block(0))


def test_block_size_is_fixed_by_the_first_put() -> None:
    store = BlockStore(memory_bytes=4 * B)
    store.put(h(0), block(0))
    with pytest.raises(BlockSizeError):
        store.put(h(1), b"x" * (B + 1))
    assert len(store) == 1


ops = st.lists(
    st.tuples(
        st.sampled_from(["put", "get", "pin", "unpin"]),
        st.integers(min_value=0, max_value=40),
    ),
    max_size=300,
)


@settings(max_examples=60, deadline=None)
@given(ops=ops, memory_blocks=st.integers(1, 6), disk_blocks=st.integers(0, 6))
def test_byte_limits_hold_and_blocks_stay_intact_under_random_workloads(
    tmp_path_factory: pytest.TempPathFactory,
    ops: list[tuple[str, int]],
    memory_blocks: int,
    disk_blocks: int,
) -> None:
    disk_dir = tmp_path_factory.mktemp("disk")
    store = BlockStore(memory_blocks * B, disk_blocks * B, disk_dir)
    pinned: dict[bytes, int] = {}
    for op, i in ops:
        if op == "put":
            stored = store.put(h(i), block(i))
            assert stored or len(pinned) >= memory_blocks  # refused only when pins fill it
        elif op == "get":
            data = store.get(h(i))
            assert data is None or data == block(i)  # never a wrong block
        elif op == "pin" and store.pin([h(i)]):
            pinned[h(i)] = pinned.get(h(i), 0) + 1
        elif op == "unpin" and pinned.get(h(i)):
            store.unpin([h(i)])
            pinned[h(i)] -= 1
            if not pinned[h(i)]:
                del pinned[h(i)]
        assert store.used_bytes(MEMORY) <= memory_blocks * B
        assert store.used_bytes(DISK) <= disk_blocks * B
        assert all(p in store for p in pinned)  # pinned blocks never leave
        assert len(store.lru[MEMORY]) + len(store.lru[DISK]) == len(store.entries)
    store.close()


def test_a_prefix_payload_is_the_blocks_in_one_buffer_with_their_checksums() -> None:
    store = BlockStore(memory_bytes=8 * B)
    for i in range(4):
        store.put(h(i), block(i))
    payload, sums = store.prefix_payload([h(0), h(1), h(2), h(9), h(3)])
    assert bytes(payload) == block(0) + block(1) + block(2)  # ends at the first miss
    assert sums == [xxhash.xxh3_64_intdigest(block(i)) for i in range(3)]
    assert store.stats.hits == 3 and store.stats.misses == 1
    store.arenas[MEMORY].view(store.entries[h(1)].slab)[5] ^= 0xFF  # corrupt in memory
    payload, sums = store.prefix_payload([h(0), h(1), h(2)])
    assert bytes(payload) == block(0) and len(sums) == 1  # a corrupt block ends it too
    assert h(1) not in store and store.stats.corrupt == 1
