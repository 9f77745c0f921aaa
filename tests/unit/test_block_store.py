"""kvcache's tiered store: slabs, exact LRU order, pins, spill and promotion, limits, checksums."""

from __future__ import annotations

from pathlib import Path

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from services.kvcache.slabs import SlabArena
from services.kvcache.store import DISK, MAX_SIZE_CLASSES, MEMORY, BlockSizeError, BlockStore

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
    assert (tmp_path / f"blocks-{B}.arena").stat().st_size == 2 * B
    store.close()


@pytest.mark.parametrize("tier", [MEMORY, DISK])
def test_a_corrupted_block_is_a_miss_and_never_served(tmp_path: Path, tier: int) -> None:
    evicted: list[bytes] = []
    store = BlockStore(memory_bytes=B, disk_bytes=B, disk_dir=tmp_path, on_evict=evicted.extend)
    store.put(h(0), block(0))
    store.put(h(1), block(1))  # 0 spills to disk
    victim = h(0) if tier == DISK else h(1)
    entry = store.entries[victim]
    store.arena(entry).view(entry.slab)[5] ^= 0xFF  # one flipped byte
    assert store.get(victim) is None
    assert store.stats.corrupt == 1 and victim not in store and evicted == [victim]
    other = h(1) if tier == DISK else h(0)
    assert store.get(other) == (block(1) if tier == DISK else block(0))


def test_blocks_of_two_sizes_share_each_tier_s_byte_limit(tmp_path: Path) -> None:
    """Two models' KV layouts: each size has its own slabs, one limit per tier holds the
    sum, and a block of one size makes room by evicting (or demoting) the least recently
    used block whatever its size; a slab given up to the other size hands its pages back."""
    big = 3 * B
    store = BlockStore(memory_bytes=4 * B, disk_bytes=3 * B, disk_dir=tmp_path)
    for i in range(4):
        assert store.put(h(i), block(i))
    assert store.used_bytes(MEMORY) == 4 * B
    assert store.put(h(10), bytes([10]) * big)  # 0, 1, 2 go to disk to make 3 x B of room
    assert store.used_bytes(MEMORY) == B + big and store.used_bytes(DISK) == 3 * B
    assert [store.entries[h(i)].tier for i in range(4)] == [DISK, DISK, DISK, MEMORY]
    assert store.block_size(h(10)) == big and store.block_size(h(0)) == B
    assert store.get(h(10)) == bytes([10]) * big and store.get(h(0)) == block(0)
    # 0 came back to memory, 3 went to disk for it
    assert [store.entries[h(i)].tier for i in (0, 1, 2, 3, 10)] == [MEMORY, *[DISK] * 3, MEMORY]
    assert store.put(h(11), bytes([11]) * big)  # 10 to disk, which drops 1, 2, 3 for it
    assert list(store.lru[MEMORY]) == [h(0), h(11)] and list(store.lru[DISK]) == [h(10)]
    assert store.stats.evicted == 3
    assert store.get(h(10)) == bytes([10]) * big  # intact after the moves
    payload, sums, size = store.prefix_payload([h(11), h(0)])  # a prefix is one size
    assert bytes(payload) == bytes([11]) * big and len(sums) == 1 and size == big
    assert store.used_bytes(MEMORY) <= 4 * B and store.used_bytes(DISK) <= 3 * B
    store.close()


def test_a_released_slab_gives_its_pages_back(tmp_path: Path) -> None:
    page = 4096
    for path in (None, tmp_path / "arena"):
        arena = SlabArena(2 * page, 4, path)
        slab = arena.alloc()
        assert slab is not None
        arena.view(slab)[:] = b"\x07" * 2 * page
        arena.free(slab)
        arena.release(slab)
        assert bytes(arena.view(slab)) == bytes(2 * page)  # dropped, not kept
        if path is not None:
            assert path.stat().st_blocks == 0  # the file's blocks too (a punched hole)
        arena.close()


def test_block_sizes_are_bounded() -> None:
    store = BlockStore(memory_bytes=1 << 20)
    for size in range(1, MAX_SIZE_CLASSES + 1):
        assert store.put(h(size), b"x" * size)
    with pytest.raises(BlockSizeError):
        store.put(h(0), b"x" * (MAX_SIZE_CLASSES + 1))
    with pytest.raises(BlockSizeError):
        store.size_class(0)
    assert len(store) == MAX_SIZE_CLASSES


def test_a_class_left_empty_makes_way_for_a_new_block_size(tmp_path: Path) -> None:
    """Models come and go on a long-lived node: once a size class holds no block (its
    model's blocks removed or evicted), a new size takes its place; one that holds a
    block is kept, with its block."""
    store = BlockStore(memory_bytes=1 << 20, disk_bytes=1 << 20, disk_dir=tmp_path)
    for size in range(1, MAX_SIZE_CLASSES + 1):
        assert store.put(h(size), b"x" * size)
    assert store.remove(h(3))  # the class of 3-byte blocks is empty now
    new = MAX_SIZE_CLASSES + 1
    assert store.put(h(new), b"y" * new)
    assert 3 not in store.classes and new in store.classes
    assert not (tmp_path / "blocks-3.arena").exists()  # its disk arena went with it
    assert store.get(h(4)) == b"x" * 4 and store.get(h(new)) == b"y" * new
    with pytest.raises(BlockSizeError):  # every class holds a block again
        store.put(h(0), b"z" * (new + 1))
    store.close()


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
    """Blocks of two sizes (two models' layouts: every third hash a double block)."""
    disk_dir = tmp_path_factory.mktemp("disk")
    store = BlockStore(memory_blocks * B, disk_blocks * B, disk_dir)
    pinned: dict[bytes, int] = {}

    def data(i: int) -> bytes:
        return block(i) * (2 if i % 3 == 0 else 1)

    for op, i in ops:
        if op == "put":
            stored = store.put(h(i), data(i))
            # refused only when the pinned blocks leave no room
            assert stored or store.pinned_bytes + len(data(i)) > memory_blocks * B
        elif op == "get":
            got = store.get(h(i))
            assert got is None or got == data(i)  # never a wrong block
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
        assert store.pinned_bytes == sum(len(data(int.from_bytes(p, "little"))) for p in pinned)
        assert len(store.lru[MEMORY]) + len(store.lru[DISK]) == len(store.entries)
        for tier in (MEMORY, DISK):  # the limit's count is the arenas' own
            held = sum(arenas[tier].used_bytes for arenas in store.classes.values())
            assert store.used_bytes(tier) == held
    store.close()


def test_a_prefix_payload_is_the_blocks_in_one_buffer_with_their_checksums() -> None:
    store = BlockStore(memory_bytes=8 * B)
    for i in range(4):
        store.put(h(i), block(i))
    payload, sums, size = store.prefix_payload([h(0), h(1), h(2), h(9), h(3)])
    assert bytes(payload) == block(0) + block(1) + block(2)  # ends at the first miss
    assert sums == [xxhash.xxh3_64_intdigest(block(i)) for i in range(3)] and size == B
    assert store.stats.hits == 3 and store.stats.misses == 1
    store.arena(store.entries[h(1)]).view(store.entries[h(1)].slab)[5] ^= 0xFF  # corrupt
    payload, sums, _ = store.prefix_payload([h(0), h(1), h(2)])
    assert bytes(payload) == block(0) and len(sums) == 1  # a corrupt block ends it too
    assert h(1) not in store and store.stats.corrupt == 1
