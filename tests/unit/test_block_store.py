"""kvcache's first store: byte limit never exceeded, LRU order, longest-prefix lookup."""

from __future__ import annotations

import random

import pytest

from services.kvcache.store import BlockStore

pytestmark = pytest.mark.unit


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_lru_eviction_order_and_prefix_lookup() -> None:
    store = BlockStore(capacity_bytes=300)
    for i in range(3):
        store.put(h(i), bytes([i]) * 100)
    assert [b[0] for b in store.prefix([h(0), h(1), h(2)])] == [0, 1, 2]
    store.prefix([h(0)])  # 0 is now the most recently used
    store.put(h(3), b"\x03" * 100)  # evicts the least recently used: 1
    assert list(store.blocks) == [h(2), h(0), h(3)]
    assert store.evictions == 1
    assert store.prefix([h(0), h(1), h(2)]) == [b"\x00" * 100]  # stops at the first miss


def test_byte_limit_never_exceeded_under_random_workload() -> None:
    rng = random.Random(5)
    store = BlockStore(capacity_bytes=10_000)
    for _ in range(2000):
        size = rng.randrange(1, 3000)
        store.put(h(rng.randrange(200)), b"x" * size)
        assert store.used_bytes == sum(len(v) for v in store.blocks.values()) <= 10_000
    assert not store.put(h(999), b"x" * 10_001)  # can never fit
