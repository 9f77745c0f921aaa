"""Rendezvous sharding of blocks over kvcache nodes, and the router's KV-event index."""

from __future__ import annotations

import os

import pytest

from shared.bus.kv_events import KVIndex
from shared.bus.messages import KVEvent
from shared.kv.sharding import owner, shard

pytestmark = pytest.mark.unit


def test_adding_a_node_moves_only_the_blocks_it_wins() -> None:
    hashes = [os.urandom(16) for _ in range(4000)]
    three = ["kv-a", "kv-b", "kv-c"]
    four = [*three, "kv-d"]
    before = {h: owner(h, three) for h in hashes}
    after = {h: owner(h, four) for h in hashes}
    moved = [h for h in hashes if before[h] != after[h]]
    assert all(after[h] == "kv-d" for h in moved)  # nothing moves between old nodes
    assert 0.18 < len(moved) / len(hashes) < 0.32  # about 1/4 of the blocks
    counts = {n: list(after.values()).count(n) for n in four}
    assert min(counts.values()) > 0.8 * len(hashes) / 4  # and the load is even
    assert owner(hashes[0], list(reversed(four))) == after[hashes[0]]  # order-independent


def test_shard_groups_positions_in_chain_order() -> None:
    hashes = [os.urandom(16) for _ in range(50)]
    groups = shard(hashes, ["x", "y"])
    assert sorted(i for g in groups.values() for i in g) == list(range(50))
    assert all(g == sorted(g) for g in groups.values())
    with pytest.raises(ValueError):
        shard(hashes, [])


def test_kv_index_applies_events_in_order() -> None:
    idx = KVIndex()
    hs = [bytes([i]) * 16 for i in range(5)]
    idx.apply(KVEvent(node_id="a", op="stored", block_hashes=hs))
    idx.apply(KVEvent(node_id="b", op="stored", block_hashes=hs[:2]))
    idx.apply(KVEvent(node_id="a", op="evicted", block_hashes=[hs[3]]))
    assert idx.prefix_blocks("a", hs) == 3
    assert idx.prefix_blocks("b", hs) == 2
    assert idx.prefix_blocks("c", hs) == 0
    idx.apply(KVEvent(node_id="c", op="stored", block_hashes=[hs[3]]))
    assert idx.union_prefix_blocks(["a", "c"], hs) == 5
    idx.apply(KVEvent(node_id="a", op="cleared"))
    assert idx.prefix_blocks("a", hs) == 0
    idx.drop_node("b")
    assert idx.union_prefix_blocks(["a", "b", "c"], hs) == 0
