"""A prefill node's batch in steps (shared/engine/prefill_steps.py): shortest first, in
steps of at most `max_num_batched_tokens` prompt tokens, each step's requests out as it
ends with their KV (exact, as one forward would give it), and nothing left behind when a
batch stops early."""

from __future__ import annotations

import random

import pytest

from shared.costs.model import CostModel
from shared.engine.engine import Engine, EngineConfig
from shared.engine.prefill_steps import PrefillRequest, prefill_steps
from shared.errors import CapacityError
from shared.model.loader import LoadedModel
from shared.sampling_params import SamplingParams
from tandem.plan.simengine import EngineShape, SimEngine
from tandem.plan.simprefill import SimBatch
from tests.unit import test_plan_simulate as simulate_tests

pytestmark = pytest.mark.unit

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


def batch() -> list[tuple[str, list[int], SamplingParams]]:
    """Short, long, short, short: as a prefill node may fetch them."""
    lengths = {"a": 20, "long": 90, "b": 20, "c": 20}
    return [(rid, prompt(n, seed), GREEDY) for seed, (rid, n) in enumerate(lengths.items())]


def test_a_batch_comes_out_shortest_first_in_steps_within_the_token_cap(
    tiny_model: LoadedModel,
) -> None:
    engine = Engine(tiny_model, EngineConfig(num_blocks=64, max_num_batched_tokens=48))
    steps = [[out.request_id for out, _, _ in step] for step in prefill_steps(engine, batch())]
    # the short ones first, in their order, two to a step (a third does not fit), then
    # the long one, fetched second, alone (over the cap, it runs by itself)
    assert steps == [["a", "b"], ["c"], ["long"]]
    assert not engine.has_unfinished() and engine.pool.num_used == 0
    # with room for all, one step, as before
    engine = Engine(tiny_model, EngineConfig(num_blocks=64, max_num_batched_tokens=4096))
    assert [len(step) for step in prefill_steps(engine, batch())] == [4]


def test_each_steps_kv_continues_exactly(tiny_model: LoadedModel) -> None:
    """Whichever step a request came out of, its first token and KV continue on a decode
    engine into the tokens it makes alone."""
    reference = Engine(tiny_model, EngineConfig(num_blocks=64)).generate(
        [p for _, p, _ in batch()], GREEDY
    )
    prefill = Engine(tiny_model, EngineConfig(num_blocks=64, max_num_batched_tokens=48))
    decode = Engine(tiny_model, EngineConfig(num_blocks=64))
    first: dict[str, int] = {}
    for step in prefill_steps(prefill, batch()):
        for out, snap, frame in step:
            assert snap is not None and frame is not None
            first[out.request_id] = out.new_token_ids[0]
            decode.add_snapshot(snap, frame)
    rest: dict[str, list[int]] = {}
    while decode.has_unfinished():
        for out in decode.step():
            rest.setdefault(out.request_id, []).extend(out.new_token_ids)
    for (rid, _, _), want in zip(batch(), reference, strict=True):
        assert [first[rid], *rest[rid]] == want


def test_a_batch_stopped_between_steps_leaves_the_engine_clean(tiny_model: LoadedModel) -> None:
    """The node closes a batch's steps when it stops early (an error between steps): the
    requests not yet prefilled go, with their blocks, and the next batch runs."""
    engine = Engine(tiny_model, EngineConfig(num_blocks=64, max_num_batched_tokens=48))
    steps = prefill_steps(engine, batch())
    assert [out.request_id for out, _, _ in next(steps)] == ["a", "b"]
    assert engine.has_unfinished()
    steps.close()
    assert not engine.has_unfinished() and engine.pool.num_used == 0
    again = [out.request_id for step in prefill_steps(engine, batch()[:1]) for out, _, _ in step]
    assert again == ["a"]


def test_an_engine_with_other_work_refuses_a_batch(tiny_model: LoadedModel) -> None:
    engine = Engine(tiny_model, EngineConfig(num_blocks=64))
    engine.add_request(prompt(10, 9), GREEDY, "running")
    with pytest.raises(RuntimeError, match="no other work"):
        next(prefill_steps(engine, batch()))
    assert engine.has_unfinished()  # its own work untouched


def sim_engine(num_blocks: int, cap: int) -> SimEngine:
    shape = EngineShape(num_blocks=num_blocks, max_num_batched_tokens=cap)
    return SimEngine(shape, CostModel(simulate_tests.profile()))


def sim_steps(engine: SimEngine, requests: list[PrefillRequest]) -> list[list[str]]:
    seqs = {rid: SimEngine.new_sequence(rid, ids, 6) for rid, ids, _ in requests}
    batch = SimBatch(engine, seqs)
    return [[seq.request_id for seq, _, _ in step] for step in prefill_steps(batch, requests)]


def test_the_simulator_steps_a_batch_as_the_node_does(tiny_model: LoadedModel) -> None:
    """The planner's prefill nodes run this same rule on their simulated engine
    (tandem/plan/simprefill.py): the same engine options give the same steps, the same
    requests in each, and the same failure when the pool cannot hold a prompt."""
    for cap in (48, 4096):
        real = Engine(tiny_model, EngineConfig(num_blocks=64, max_num_batched_tokens=cap))
        want = [[out.request_id for out, _, _ in step] for step in prefill_steps(real, batch())]
        sim = sim_engine(64, cap)
        assert sim_steps(sim, batch()) == want
        assert not sim.scheduler.has_unfinished() and sim.scheduler.pool.num_used == 0
    # 5 blocks of 16 tokens: the 90-token prompt (and its max_tokens) never fits, and the
    # engine refuses it as it is added: the batch fails before any step, and is gone
    real = Engine(tiny_model, EngineConfig(num_blocks=5, max_num_batched_tokens=48))
    sim = sim_engine(5, 48)
    with pytest.raises(CapacityError, match="in total"):
        next(prefill_steps(real, batch()))
    with pytest.raises(CapacityError, match="in total"):
        sim_steps(sim, batch())
    assert not real.has_unfinished() and real.pool.num_used == 0
    assert not sim.scheduler.has_unfinished() and sim.scheduler.pool.num_used == 0
