"""The hand-off's rules, shared by prefill nodes and the simulator
(services/prefill/handoff_rules.py): whom a prefilled sequence is offered to, in what
order, and the backoff when none has room."""

from __future__ import annotations

import msgspec
import pytest

from services.prefill.handoff_rules import (
    FIRST_DELAY,
    MAX_DELAY,
    next_delay,
    offer_order,
    takes_kv_of,
)
from tandem.plan import simprefill
from tests.unit.test_routing import KEY, decode_node

pytestmark = pytest.mark.unit


def test_the_routers_choice_first_then_most_free_blocks() -> None:
    nodes = [decode_node("d1", free=10), decode_node("d2", free=90), decode_node("d3", free=50)]
    order = offer_order(nodes, "d1", lambda n: n.node_id, lambda n: n.free_kv_blocks)
    assert [n.node_id for n in order] == ["d1", "d2", "d3"]
    order = offer_order(nodes, "gone", lambda n: n.node_id, lambda n: n.free_kv_blocks)
    assert [n.node_id for n in order] == ["d2", "d3", "d1"]


def test_only_live_decode_nodes_of_the_same_key() -> None:
    node = decode_node("d1")
    assert takes_kv_of(node, KEY)
    assert takes_kv_of(msgspec.structs.replace(node, hash_key=""), KEY)  # an older node
    assert not takes_kv_of(node, "another-model/float32")
    assert not takes_kv_of(msgspec.structs.replace(node, draining=True), KEY)
    assert not takes_kv_of(msgspec.structs.replace(node, role="prefill"), KEY)


def test_backoff_doubles_to_its_ceiling() -> None:
    delays = [FIRST_DELAY]
    while delays[-1] < MAX_DELAY:
        delays.append(next_delay(delays[-1]))
    assert delays[:3] == [0.05, 0.1, 0.2] and delays[-1] == MAX_DELAY == next_delay(MAX_DELAY)


def test_the_simulator_runs_the_same_rules() -> None:
    assert simprefill.offer_order is offer_order and simprefill.next_delay is next_delay
