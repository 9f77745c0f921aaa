"""The hand-off's rules, shared by prefill nodes and the simulator
(services/prefill/handoff_rules.py): whom a prefilled sequence is offered to, in what
order, and the backoff when none has room; and the decode node's own (shared/engine/
limits.py): when it refuses one, which the real node's receiver and the simulated node
both ask."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import msgspec
import pytest

from services.prefill.handoff_rules import (
    FIRST_DELAY,
    MAX_DELAY,
    next_delay,
    offer_order,
    takes_kv_of,
)
from shared.bus.ids import AttemptId
from shared.bus.messages import DecodeAssignment, SequenceSnapshot, encode
from shared.connector import receiver
from shared.connector.receiver import KVReceiver
from shared.costs.model import CostModel
from shared.engine.engine import Engine, EngineConfig
from shared.engine.limits import handoff_refusal
from shared.model.loader import LoadedModel
from shared.sampling_params import SamplingParams
from tandem.plan import simengine, simprefill
from tandem.plan.simengine import EngineShape, SimEngine
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


def test_a_decode_node_with_sequences_waiting_takes_no_hand_off() -> None:
    """Sequences preempted for KV room wait first: a hand-off taken into the room a
    preemption freed was preempted in turn, and a simulated H100 node short of KV went on
    recomputing prompts for minutes (1,787 of them queued)."""
    assert handoff_refusal(free_blocks=100, blocks=10, waiting=0, running=0) is None
    assert handoff_refusal(10, 10, 0, 0) == "not enough free KV blocks"  # and one to grow into
    assert handoff_refusal(100, 10, 1, 0) == "sequences wait here for KV room"
    assert receiver.handoff_refusal is handoff_refusal is simengine.handoff_refusal
    # the simulated node: full, it preempts; while the preempted one waits, it refuses
    shape = EngineShape(block_size=4, max_num_seqs=8, num_blocks=10, enable_prefix_caching=False)
    engine = SimEngine(shape, CostModel.__new__(CostModel))
    first, second = (SimEngine.new_sequence(f"r{k}", [1] * 16, 8) for k in range(2))
    for seq in (first, second):
        seq.num_computed, seq.output_ids = 16, [7]  # its first token, pending
        assert engine.add_prefilled(seq)  # 4 blocks each, 2 left
    engine.scheduler.pool.allocate(2)  # (taken by what else runs here: the pool is full)
    engine.scheduler.plan_step()  # both need a 5th block for their next token: one goes
    assert engine.scheduler.num_preemptions == 1 and len(engine.scheduler.waiting) == 1
    third = SimEngine.new_sequence("r2", [1] * 3, 8)
    third.num_computed = 3
    assert engine.scheduler.pool.num_free >= 3 and not engine.add_prefilled(third)
    engine.scheduler.remove(engine.scheduler.waiting[0])  # (it ran and ended)
    engine.add(SimEngine.new_sequence("r3", [1] * 3, 8))  # a new prompt to prefill here
    assert engine.scheduler.num_waiting_midstream == 0  # the normal flow: stops nothing
    assert engine.add_prefilled(third)


def test_a_decode_node_keeps_a_block_for_each_running_stream() -> None:
    """Taken down to its last free block, a node preempted as soon as its streams grew
    (a simulated H100 cluster, half its KV free, preempted a few sequences a minute per
    node, and refused every hand-off while each one's prompt was recomputed)."""
    assert handoff_refusal(free_blocks=15, blocks=10, waiting=0, running=4) is None
    assert handoff_refusal(14, 10, 0, 4) == "not enough free KV blocks"
    shape = EngineShape(block_size=4, max_num_seqs=8, num_blocks=10, enable_prefix_caching=False)
    engine = SimEngine(shape, CostModel.__new__(CostModel))
    first, second = (SimEngine.new_sequence(f"r{k}", [1] * 16, 8) for k in range(2))
    for seq in (first, second):
        seq.num_computed, seq.output_ids = 16, [7]
    assert engine.add_prefilled(first)  # 4 of 10 blocks: 6 free
    engine.scheduler.pool.allocate(1)  # 5 free: 4 for the second, 1 for its next token...
    assert not engine.add_prefilled(second)  # ... and none for the first's: refused
    assert engine.scheduler.num_running == 1 and engine.scheduler.pool.num_free == 5
    engine.scheduler.plan_step()  # the first grows into its block: nothing preempted
    assert engine.scheduler.num_preemptions == 0


async def test_a_real_decode_node_asks_the_rule_with_its_running_streams(
    tiny_model: LoadedModel,
) -> None:
    """The receiver (shared/connector/receiver.py) passes the engine's running sequences:
    room for the sequence's blocks alone is refused while streams run there."""
    engine = Engine(tiny_model, EngineConfig(num_blocks=24, enable_prefix_caching=False))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for k in range(3):
        engine.add_request([5 + k] * 20, params, f"run-{k}")
    engine.step()  # prefilled: three streams running
    running, free = engine.num_running, engine.pool.num_free
    assert running == 3 and free > running + 2
    node = SimpleNamespace(draining=False)
    receiver = KVReceiver(node, engine, cast(Any, None), cast(Any, None), "decode-0", "tcp")

    async def offer(blocks: int) -> bytes:
        tokens = blocks * engine.config.block_size
        snap = SequenceSnapshot(AttemptId("cmpl-x"), [9] * tokens, [], params, tokens)
        assignment = DecodeAssignment(
            transfer_id="t-x", snapshot=snap, token_subject="tandem.tokens.cmpl-x"
        )
        msg = SimpleNamespace(data=encode(assignment), subject="tandem.decode.decode-0.assign")
        answers: list[bytes] = []

        async def respond(data: bytes) -> None:
            answers.append(data)

        msg.respond = respond
        await receiver.on_assign(cast(Any, msg))
        return answers[0]

    assert b"not enough free KV blocks" in await offer(free - running)  # none to grow into
    assert not receiver.expected
    assert b"not enough" not in await offer(free - running - 1)  # a block for each
    assert list(receiver.expected) == ["t-x"]
