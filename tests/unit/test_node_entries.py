"""What a model node reports of its load in its registry entry, written once
(shared/bus/registry.py) for the nodes' `info()` and the planner's simulated nodes: a
decode node's load is what runs and what waits, its free blocks net of promises and never
below 0; a prefill node's load is the batch it fetched. (The simulated nodes build theirs
with these: tests/unit/test_plan_simulate.py checks a prefill node's load mid-batch.)"""

from __future__ import annotations

import pytest

from shared.bus.registry import decode_entry, prefill_entry

pytestmark = pytest.mark.unit


def test_a_decode_nodes_load_and_free_blocks() -> None:
    entry = decode_entry("d1", running=3, waiting=2, free_blocks=-4, total_blocks=90,
                         model="m", draining=True)  # fmt: skip
    assert (entry.role, entry.load, entry.running) == ("decode", 5, 3)
    assert (entry.free_kv_blocks, entry.total_kv_blocks) == (0, 90)  # promised past the pool
    assert entry.model == "m" and entry.draining and entry.timestamp > 0
    assert decode_entry("d1", running=0, waiting=0, free_blocks=7, total_blocks=9,
                        now=12.5).timestamp == 12.5  # fmt: skip


def test_a_prefill_nodes_load_is_its_batch() -> None:
    entry = prefill_entry("p1", batch=4, free_blocks=10, total_blocks=20)
    assert (entry.role, entry.load, entry.running, entry.free_kv_blocks) == ("prefill", 4, 0, 10)
