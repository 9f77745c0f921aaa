"""`tandem plan simulate`: the simulator against cases whose answer is known in closed form,
and its command against `tandem bench serve`'s document."""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics

import msgspec
import pytest

from shared.costs.model import CostModel, interpolate
from shared.costs.profile import (
    PROFILE_VERSION,
    DecodePoint,
    KVCopyPoint,
    Machine,
    PrefillPoint,
    Profile,
    TransferPoint,
)
from shared.kv.block_pool import BlockPool
from tandem.bench.loadgen import arrival_times
from tandem.bench.metrics import RequestRecord, itls
from tandem.plan import simengine, simulate
from tandem.plan.simengine import CountingPool, EngineShape
from tandem.plan.simulator import Simulation
from tandem.plan.topology import Arrival, Topology

PREFILL_PER_TOKEN = 0.001  # s: a 500-token prompt prefills in 0.5 s
DECODE_STEP = 0.05  # s, at any batch and context
LINK = 1e9  # bytes/s
KV_PER_TOKEN = 1000  # bytes


def profile(decode_grows: bool = False) -> Profile:
    def step(batch: int, context: int) -> float:
        return DECODE_STEP + (0.001 * batch + 1e-5 * context if decode_grows else 0.0)

    return Profile(
        version=PROFILE_VERSION,
        machine=Machine(cpu="test", cpu_flags=[], cores=1, device="cpu"),
        model="test",
        dtype="float32",
        threads=1,
        torch="test",
        kv_bytes_per_token=KV_PER_TOKEN,
        prefill=[
            PrefillPoint(tokens=t, batch=1, seconds=t * PREFILL_PER_TOKEN) for t in (64, 4096)
        ],
        decode=[
            DecodePoint(batch=b, context=c, seconds=step(b, c))
            for b in (1, 64)
            for c in (128, 4096)
        ],
        transfer=[TransferPoint(transport="tcp", bytes=n, seconds=n / LINK) for n in (1, 1 << 30)],
        created=0.0,
    )


def shape(budget: int = 0) -> EngineShape:
    return EngineShape(num_blocks=4096, step_token_budget=budget)


def split(prefill_max_batch: int = 8) -> Topology:
    return Topology(
        prefill=1,
        decode=1,
        decode_engine=shape(),
        prefill_engine=shape(),
        prefill_max_batch=prefill_max_batch,
    )


def test_interpolation_is_linear_inside_and_extends_outside() -> None:
    assert interpolate([0, 10], [0, 1], 5) == pytest.approx(0.5)
    assert interpolate([0, 10, 20], [0, 1, 3], 30) == pytest.approx(5.0)
    assert interpolate([10, 20], [1, 2], 0) == pytest.approx(0.0)  # never negative
    costs = CostModel(profile(decode_grows=True))
    assert costs.decode(32, 1000) == pytest.approx(DECODE_STEP + 0.032 + 0.01, rel=0.02)
    assert costs.prefill(500) == pytest.approx(0.5)
    assert costs.kv_transfer(1000) == pytest.approx(1000 * KV_PER_TOKEN / LINK)


def test_one_request_colocated() -> None:
    sim = Simulation(Topology(colocated=1, decode_engine=shape(256)), CostModel(profile()))
    (rec,) = sim.run([Arrival(0.0, 500, 10)])
    assert rec.ok and rec.output_tokens == 10
    assert rec.chunks[0] == pytest.approx(0.5)  # alone: its prompt prefills whole
    assert rec.done == pytest.approx(0.5 + 9 * DECODE_STEP)
    assert itls(rec) == pytest.approx([DECODE_STEP] * 9)


def test_one_request_split_pays_the_transfer() -> None:
    sim = Simulation(split(), CostModel(profile()))
    (rec,) = sim.run([Arrival(0.0, 500, 10)])
    transfer = 500 * KV_PER_TOKEN / LINK
    assert rec.chunks[0] == pytest.approx(0.5)  # the prefill node publishes it
    assert rec.chunks[0] + itls(rec)[0] == pytest.approx(0.5 + transfer + DECODE_STEP)
    assert rec.done == pytest.approx(0.5 + transfer + 9 * DECODE_STEP)


def test_kv_copies_delay_the_first_token_and_the_running_streams() -> None:
    """With the profile's KV copies: a prefill node's export comes before its first token
    goes out; a decode node's import of a handed-off prompt runs before its next step, so
    a stream already running there sees that step longer by the import."""
    export, imported = 0.02, 0.03  # s per 500 tokens (linear through zero)
    copies = [
        KVCopyPoint(op=op, tokens=t, seconds=per * t / 500)
        for op, per in (("export", export), ("import", imported))
        for t in (100, 500)
    ]
    costs = CostModel(msgspec.structs.replace(profile(), kv_copy=copies))
    transfer = 500 * KV_PER_TOKEN / LINK
    for macro in (True, False):
        topology = dataclasses.replace(split(), macro_steps=macro)
        (rec,) = Simulation(topology, costs).run([Arrival(0.0, 500, 10)])
        assert rec.chunks[0] == pytest.approx(0.5 + export)
        assert rec.done == pytest.approx(0.5 + export + transfer + imported + 9 * DECODE_STEP)
        # a stream decoding when the second prompt lands: one gap longer by its import
        first, _ = Simulation(topology, costs).run([Arrival(0.0, 100, 40), Arrival(0.5, 500, 2)])
        gaps = sorted(itls(first)[1:])  # past its own hand-off's (transfer and import)
        assert gaps[-1] == pytest.approx(DECODE_STEP + imported)
        assert gaps[-2] == pytest.approx(DECODE_STEP)


def test_checkpointing_decode_nodes_pay_a_copy_per_token_computed() -> None:
    """With kvcache nodes, a decode node copies each block it fills out of its pool: the
    profile's checkpoint cost of a block, spread over its tokens, in every step."""
    per_token = 0.0001
    copies = [KVCopyPoint(op="checkpoint", tokens=t, seconds=t * per_token) for t in (16, 1024)]
    costs = CostModel(msgspec.structs.replace(profile(), kv_copy=copies))
    for macro in (True, False):
        topology = Topology(colocated=1, decode_engine=shape(256), kvcache=1, macro_steps=macro)
        (rec,) = Simulation(topology, costs).run([Arrival(0.0, 500, 10)])
        assert rec.chunks[0] == pytest.approx(0.5 + 500 * per_token)
        assert itls(rec) == pytest.approx([DECODE_STEP + per_token] * 9)
        without = dataclasses.replace(topology, kvcache=0)
        (plain,) = Simulation(without, costs).run([Arrival(0.0, 500, 10)])
        assert itls(plain) == pytest.approx([DECODE_STEP] * 9)


def test_a_hand_off_ends_when_the_decode_node_has_taken_the_kv() -> None:
    """A decode node imports between its steps: a hand-off landing mid-step ends (and
    frees the prefill node for its next job) when that step does, not when the bytes land;
    the prefill node then takes its next job at once."""
    transfer = 500 * KV_PER_TOKEN / LINK
    for macro in (True, False):
        topology = dataclasses.replace(split(prefill_max_batch=1), macro_steps=macro)
        sim = Simulation(topology, CostModel(profile()))
        _, b, c = sim.run([Arrival(0.0, 500, 100), Arrival(0.0, 500, 5), Arrival(0.0, 500, 5)])
        # a's KV lands on an idle node: taken at once; its steps run from then on
        start = 0.5 + transfer
        assert b.chunks[0] == pytest.approx(start + 0.5)
        # b's KV lands mid-step (steps end at start + k x 50 ms): taken when it ends
        taken = start + 11 * DECODE_STEP
        assert b.chunks[0] + transfer < taken
        assert b.chunks[0] + itls(b)[0] == pytest.approx(taken + DECODE_STEP)
        assert c.chunks[0] == pytest.approx(taken + 0.5)  # it waited for that


def test_chunked_prefill_spreads_a_long_prompt_over_decode_steps() -> None:
    """A 2,000-token prompt arriving beside a running stream: with a 256-token budget, the
    stream's gaps grow by a chunk's time per step instead of by the whole prefill."""
    costs = CostModel(profile())

    def worst_gap(budget: int) -> float:
        sim = Simulation(Topology(colocated=1, decode_engine=shape(budget)), costs)
        first, _ = sim.run([Arrival(0.0, 100, 60), Arrival(0.3, 2000, 2)])
        return max(itls(first))

    assert worst_gap(0) == pytest.approx(2.0 + DECODE_STEP, rel=0.01)
    assert worst_gap(256) == pytest.approx(255 * PREFILL_PER_TOKEN + DECODE_STEP, rel=0.01)


def test_deterministic_queue_waits_grow_by_the_service_gap() -> None:
    """D/D/1: one prefill node serving one 500-token job at a time (0.5 s), a job every
    0.4 s: the k-th waits k x 0.1 s longer than the first."""
    sim = Simulation(split(prefill_max_batch=1), CostModel(profile()))
    records = sim.run([Arrival(0.4 * k, 500, 1) for k in range(10)])
    ttfts = [r.chunks[0] - r.sent for r in records]
    assert ttfts == pytest.approx([0.5 + 0.1 * k for k in range(10)])


def test_md1_mean_wait_matches_its_formula() -> None:
    """M/D/1: Poisson arrivals at rate λ, deterministic service S, one server:
    mean wait in queue = λ S² / (2 (1 − ρ)), ρ = λ S (Pollaczek–Khinchine). The server is
    the prefill node, busy S = 0.5 s of prefill."""
    prefill, lam, n = 0.5, 1.4, 20000  # ρ = 0.7
    service = prefill
    rng = random.Random(5)
    offsets = arrival_times(n, lam, "poisson", rng)
    sim = Simulation(split(prefill_max_batch=1), CostModel(profile()))
    records = sim.run([Arrival(at, 500, 1) for at in offsets])
    waits = [r.chunks[0] - r.sent - prefill for r in records[n // 10 :]]  # past the warm-up
    rho = lam * service
    expected = lam * service**2 / (2 * (1 - rho))
    assert statistics.mean(waits) == pytest.approx(expected, rel=0.08)


def test_decode_node_without_room_makes_the_hand_off_wait() -> None:
    """A decode pool that holds one sequence: the second request's KV waits on the prefill
    node (retried with backoff) until the first finishes; nothing is lost."""
    tight = Topology(
        prefill=1,
        decode=1,
        decode_engine=EngineShape(num_blocks=40),  # 40 x 16 tokens: one 500 + 100 request
        prefill_engine=shape(),
    )
    sim = Simulation(tight, CostModel(profile()))
    a, b = sim.run([Arrival(0.0, 500, 100), Arrival(0.0, 500, 100)])
    assert a.ok and b.ok and a.output_tokens == b.output_tokens == 100
    # its decoding began only once the first freed its blocks
    assert b.chunks[0] + itls(b)[0] >= a.done


def test_topology_is_checked() -> None:
    with pytest.raises(ValueError, match="either colocated"):
        Simulation(Topology(colocated=1, prefill=1, decode=1), CostModel(profile()))
    with pytest.raises(ValueError, match="at least one decode"):
        Simulation(Topology(prefill=1), CostModel(profile()))
    with pytest.raises(ValueError, match="needs a prefill node"):
        Simulation(Topology(decode=1), CostModel(profile()))


def test_a_conditional_router_with_no_prefill_node_prefills_on_the_decode_node() -> None:
    """`--conditional` with no prefill node up (an autoscaled pool at 0): its chooser
    sends every prompt to the decode node, which prefills it as a colocated one does."""
    topology = Topology(prefill=0, decode=1, decode_engine=shape(256), conditional=True)
    (rec,) = Simulation(topology, CostModel(profile())).run([Arrival(0.0, 500, 10)])
    assert rec.ok and rec.output_tokens == 10
    assert rec.chunks[0] == pytest.approx(0.5)  # no hand-off: no transfer before it
    assert rec.done == pytest.approx(0.5 + 9 * DECODE_STEP)


def test_a_decode_node_without_room_refuses_a_local_prefill_as_the_node_does() -> None:
    """The simulated decode node takes or refuses a local prefill by the node's own rule
    (room for the prompt and one block more); with no prefill pool to fall back on, the
    refused request gets the router's 503, as a real conditional router scaled to no
    prefill node answers, instead of waiting in the node's queue."""
    topology = Topology(prefill=0, decode=1, decode_engine=EngineShape(num_blocks=40),
                        conditional=True)  # fmt: skip
    first, second = Simulation(topology, CostModel(profile())).run(
        [Arrival(0.0, 500, 100), Arrival(0.01, 200, 10)]
    )
    assert first.ok and first.output_tokens == 100  # 32 of the 40 blocks
    assert not second.ok and "retry shortly" in (second.error or "")  # 13 + 1 > 8 free
    later = Simulation(topology, CostModel(profile())).run(
        [Arrival(0.0, 500, 100), Arrival(0.01, 100, 10)]
    )
    assert all(r.ok for r in later)  # 7 blocks and one more fit in the 8 left


def test_a_prefill_nodes_load_is_its_batch_until_the_last_hand_off() -> None:
    """A prefill node reports the size of the batch it fetched as its load (the router's
    entry) and queue depth (the autoscaler's sample) until its last hand-off, as the node
    does (`queue_depth`), not a count of what is left to hand off."""
    capped = EngineShape(num_blocks=4096, max_num_batched_tokens=128)  # a step a prompt
    sim = Simulation(Topology(prefill=1, decode=1, decode_engine=shape(), prefill_engine=capped),
                     CostModel(profile()))  # fmt: skip
    node = sim.prefillers["prefill-0"]
    seen: list[tuple[int, int]] = []
    for t in (0.2, 0.5, 0.9):  # the first batch (300); the second (100, then 300); none
        sim.at(t, lambda: seen.append((sim._info("prefill-0").load, node.holding)))
    records = sim.run([Arrival(0.0, 300, 40), Arrival(0.01, 100, 40), Arrival(0.02, 300, 40)])
    assert all(r.ok for r in records)
    assert seen == [(1, 1), (2, 1), (0, 0)]  # at 0.5 the 100-token prompt is handed off


def test_a_job_the_prefill_pool_cannot_hold_fails_alone() -> None:
    """As a prefill node checks each fetched job before its batch: one whose prompt and
    max_tokens need more blocks than the pool has in all fails by itself, and the jobs
    fetched with it are prefilled."""
    small = EngineShape(num_blocks=20)  # 320 tokens
    sim = Simulation(Topology(prefill=1, decode=1, decode_engine=shape(), prefill_engine=small),
                     CostModel(profile()))  # fmt: skip
    short, big, other = sim.run([Arrival(0.0, 100, 4), Arrival(0.0, 400, 4), Arrival(0.0, 100, 4)])
    assert short.ok and other.ok
    assert not big.ok and "in total" in (big.error or "")


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    simulate.add_parser(parser.add_subparsers())
    return parser.parse_args(["simulate", *argv])


def test_command_writes_bench_serves_document(tmp_path: pytest.TempPathFactory) -> None:
    prof = tmp_path / "p.json"  # type: ignore[operator]
    prof.write_bytes(msgspec.json.encode(profile()))
    out = tmp_path / "sim.json"  # type: ignore[operator]
    args = _args(
        "--profile", str(prof), "--prefill", "1", "--decode", "1",
        "--prompt-len", "mix:100:1500:0.2",
        "--output-len", "20", "--num-requests", "12", "--request-rate", "0.5,1", "--output",
        str(out), "--quiet",
    )  # fmt: skip
    assert simulate.run(args) == 0
    doc = json.loads(out.read_text())
    assert doc["tool"] == "tandem plan simulate" and doc["simulated"] is True
    (sweep,) = doc["sweeps"]
    assert [p["request_rate"] for p in sweep["points"]] == [0.5, 1]
    for point in sweep["points"]:
        assert point["metrics"]["completed"] == 12
        assert {"ttft", "tpot", "itl", "e2e", "slo_attainment"} <= point["metrics"].keys()
        lengths = sorted({r["prompt_tokens"] for r in point["requests"]})
        assert set(lengths) <= {100, 1500}
    # replayed: the same requests at the same send times give the same result
    again = tmp_path / "again.json"  # type: ignore[operator]
    replay = _args("--profile", str(prof), "--prefill", "1", "--decode", "1", "--trace", str(out),
                   "--output", str(again), "--quiet")  # fmt: skip
    assert simulate.run(replay) == 0
    first, second = (json.loads(p.read_text())["sweeps"][0]["points"] for p in (out, again))
    for a, b in zip(first, second, strict=True):  # (send times are stored to the microsecond)
        assert a["metrics"]["ttft"]["p90"] == pytest.approx(b["metrics"]["ttft"]["p90"], abs=1e-5)
        assert a["metrics"]["tpot"]["p50"] == pytest.approx(b["metrics"]["tpot"]["p50"], abs=1e-5)


def test_command_refuses_bad_input(
    tmp_path: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.json"  # type: ignore[operator]
    bad.write_text('{"version": 99}')
    assert simulate.run(_args("--profile", str(bad), "--colocated", "1", "--quiet")) == 2
    assert "profile version 99" in capsys.readouterr().err
    assert simulate.run(_args("--profile", str(bad), "--quiet")) == 2  # no deployment
    assert "at least one decode" in capsys.readouterr().err


def test_a_prefill_batch_larger_than_the_prefill_pool_still_goes_through() -> None:
    """8 jobs of 500 tokens on a prefill node whose pool holds ~1 of them: each prompt's
    blocks are freed as soon as its KV is out (as `prefill_and_export` does), so every one
    is prefilled in turn; nothing fails, nothing hangs."""
    topo = Topology(
        prefill=1,
        decode=1,
        decode_engine=shape(),
        prefill_engine=EngineShape(num_blocks=40),
        prefill_max_batch=8,  # the 7 queued behind the first in one batch
    )
    records = Simulation(topo, CostModel(profile())).run([Arrival(0.0, 500, 4)] * 8)
    assert all(r.ok and r.output_tokens == 4 for r in records)
    # one after another (the first alone, then the 7 queued meanwhile), plus a hand-off
    assert max(r.chunks[0] for r in records) == pytest.approx(8 * 0.5, abs=0.01)


def test_a_prefill_batch_comes_out_step_by_step_within_its_token_cap() -> None:
    """As `prefill_steps` does: jobs fetched together are prefilled shortest first, in
    steps of at most the node's step tokens, each step's first tokens out as it ends. Two
    500-token prompts fetched with a short one behind them: with a 600-token cap the short
    one and the first long one are out 0.5 s before the other (the next step); with room
    for all, together."""

    def first_tokens(cap: int) -> list[float]:
        topo = Topology(
            prefill=1,
            decode=1,
            decode_engine=shape(),
            prefill_engine=EngineShape(num_blocks=4096, max_num_batched_tokens=cap),
            prefill_max_batch=4,
        )
        # the first keeps the node busy while the other three queue, fetched together next
        arrivals = [Arrival(0.0, 100, 2)] + [Arrival(0.01, n, 2) for n in (500, 500, 100)]
        records = Simulation(topo, CostModel(profile())).run(arrivals)
        assert all(r.ok for r in records)
        return [r.chunks[0] for r in records[1:]]

    long1, long2, short = first_tokens(600)
    assert long2 - long1 == pytest.approx(0.5, abs=0.01)  # the second step: 500 alone
    assert short == pytest.approx(long1, abs=1e-6)  # the first step: 100 + 500
    long1, long2, short = first_tokens(4096)
    assert long1 == pytest.approx(long2, abs=1e-6) == pytest.approx(short, abs=1e-6)


def test_hand_offs_to_another_decode_node_keep_each_stream_its_own() -> None:
    """Two decode nodes that hold one request each: hand-offs fall back to the other node,
    and request ids stay distinct across nodes, so every record gets exactly its tokens."""
    topo = Topology(
        prefill=1, decode=2, decode_engine=EngineShape(num_blocks=40), prefill_engine=shape()
    )
    records = Simulation(topo, CostModel(profile())).run(
        [Arrival(0.01 * i, 500, 30) for i in range(6)]
    )
    assert [r.output_tokens for r in records] == [30] * 6
    assert all(r.ok and 1 + len(itls(r)) == 30 for r in records)


def test_a_request_that_cannot_finish_times_out() -> None:
    topo = Topology(colocated=1, decode_engine=EngineShape(num_blocks=4096, max_num_seqs=1))
    long, short = Arrival(0.0, 100, 4000), Arrival(0.0, 100, 5)  # 4,000 x 50 ms > 60 s
    records = Simulation(topo, CostModel(profile())).run([long, short], timeout=60)
    assert records[0].error is not None and "60" in records[0].error
    assert records[1].error is not None  # waited behind it for a seat, past its timeout


def test_admission_latency_comes_before_the_node_sees_the_request() -> None:
    topo = Topology(colocated=1, decode_engine=shape(256), admission_latency=0.05)
    (rec,) = Simulation(topo, CostModel(profile())).run([Arrival(0.0, 500, 3)])
    assert rec.chunks[0] == pytest.approx(0.55)
    assert rec.done == pytest.approx(0.55 + 2 * DECODE_STEP)


def test_admission_latency_delays_each_request_from_its_own_send() -> None:
    """Requests sent closer together than the admission latency are each planned that
    long after their own send, not queued behind one another's admission."""
    topo = Topology(colocated=2, decode_engine=shape(256), admission_latency=0.05)
    sends = [0.0, 0.001, 0.002, 0.003]
    records = Simulation(topo, CostModel(profile())).run([Arrival(t, 64, 1) for t in sends])
    assert [r.sent for r in records] == sends
    # two nodes, two prompts each (one step: 128 tokens of a 256-token budget)
    ttfts = [r.chunks[0] - r.sent for r in records]
    assert max(ttfts) < 0.05 + 2 * 64 * PREFILL_PER_TOKEN + 0.01


def test_timeouts_end_only_the_requests_past_theirs() -> None:
    """Each request gives up `timeout` after its own send; those done in time, or sent
    after it, are not touched. One sequence at a time, 50 ms a token."""
    topo = Topology(colocated=1, decode_engine=EngineShape(num_blocks=4096, max_num_seqs=1))
    arrivals = [
        Arrival(0.0, 100, 3),
        Arrival(0.0, 100, 150),  # ~7.8 s: within 10
        Arrival(1.0, 100, 3),  # waits for it, done by ~8.1 s: within 11
        Arrival(2.0, 100, 100),  # starts at ~8.1, needs 5 s: past 12
        Arrival(20.0, 100, 3),
    ]
    records = Simulation(topo, CostModel(profile())).run(arrivals, timeout=10)
    assert [r.ok for r in records] == [True, True, True, False, True]
    assert records[3].done == pytest.approx(12.0) and "10" in (records[3].error or "")


def test_a_timeout_shorter_than_the_admission_latency_never_turns_time_back() -> None:
    topo = Topology(colocated=1, decode_engine=shape(256), admission_latency=0.05)
    sim = Simulation(topo, CostModel(profile()))
    records = sim.run([Arrival(0.0, 100, 3), Arrival(0.01, 100, 3)], timeout=0.02)
    assert all(r.error is not None for r in records)
    assert [r.done for r in records] == pytest.approx([0.05, 0.06])  # as it is planned
    assert sim.now == pytest.approx(0.06)


def mixed_arrivals() -> list[Arrival]:
    """80 requests over a minute: short, medium and long prompts, 1-200 tokens out."""
    rng = random.Random(3)
    return [
        Arrival(rng.uniform(0, 60), rng.choice([40, 300, 900]), rng.randint(1, 200))
        for _ in range(80)
    ]


def timeline(r: RequestRecord) -> list[float]:
    """Its outcome, then its first token, every gap after it and its end."""
    return [float(r.ok), float(r.output_tokens), *r.chunks[:1], *itls(r), r.done]


@pytest.mark.parametrize(
    ("topology", "tight"),
    [
        (
            Topology(colocated=2, decode_engine=EngineShape(num_blocks=400, step_token_budget=256)),
            False,
        ),
        (Topology(colocated=1, decode_engine=EngineShape(num_blocks=200, max_num_seqs=8)), True),
        (Topology(prefill=2, decode=2, decode_engine=EngineShape(num_blocks=300)), False),
        (Topology(prefill=1, decode=2, decode_engine=shape(256), conditional=True), False),
        (
            Topology(
                prefill=1, decode=2, decode_engine=shape(256), conditional=True, tpot_target=0.07
            ),
            False,
        ),
    ],
    ids=["colocated-chunked", "colocated-preempting", "split", "conditional", "conditional-tpot"],
)
def test_steady_runs_give_the_stepwise_timelines(topology: Topology, tight: bool) -> None:
    """Runs of steady decode steps, cut by whatever arrives, give every request the
    timeline the simulation stepping one event a step gives, in fewer events; also where
    a tight pool preempts and requests time out."""
    arrivals = mixed_arrivals()
    costs = CostModel(profile())
    runs = Simulation(topology, costs)
    fast = runs.run(arrivals, timeout=30)
    stepwise = Simulation(dataclasses.replace(topology, macro_steps=False), costs)
    slow = stepwise.run(arrivals, timeout=30)
    assert [r.ok for r in fast] == [r.ok for r in slow]
    for a, b in zip(fast, slow, strict=True):
        assert timeline(a) == pytest.approx(timeline(b), abs=1e-9)
    # every token came once, preempted or not: its gaps are its tokens after the first
    assert all(len(itls(r)) == r.output_tokens - 1 == r.max_tokens - 1 for r in fast if r.ok)
    assert runs.events < stepwise.events
    preempted = sum(d.engine.scheduler.num_preemptions for d in runs.decoders.values())
    if tight:
        assert preempted > 0 and not all(r.ok for r in fast)
    else:
        assert all(r.ok for r in fast) and runs.events < stepwise.events / 2


def test_steady_runs_give_the_stepwise_timelines_with_kv_copies() -> None:
    """Imports stalling a decode node between steps cut runs as a stepwise node sees them."""
    copies = [
        KVCopyPoint(op=op, tokens=t, seconds=t * 4e-5)
        for op in ("export", "import")
        for t in (1, 1000)
    ]
    costs = CostModel(msgspec.structs.replace(profile(), kv_copy=copies))
    topology = Topology(prefill=2, decode=2, decode_engine=EngineShape(num_blocks=300))
    fast = Simulation(topology, costs).run(mixed_arrivals(), timeout=30)
    stepwise = dataclasses.replace(topology, macro_steps=False)
    slow = Simulation(stepwise, costs).run(mixed_arrivals(), timeout=30)
    plain = Simulation(topology, CostModel(profile())).run(mixed_arrivals(), timeout=30)
    for a, b in zip(fast, slow, strict=True):
        assert timeline(a) == pytest.approx(timeline(b), abs=1e-9)
    assert all(r.ok for r in fast)
    assert sum(r.done for r in fast) > sum(r.done for r in plain)  # the copies cost


@pytest.mark.parametrize("colocated", [True, False])
def test_counting_pool_decides_as_the_real_pool(
    colocated: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without prefix caching the simulator's engines count free blocks instead of keeping
    the real pool's ids: the same timelines, preemptions and timeouts as the real pool."""
    engine = EngineShape(num_blocks=200, max_num_seqs=8, enable_prefix_caching=False)
    topology = Topology(colocated=1, decode_engine=engine) if colocated else split()
    topology = dataclasses.replace(topology, decode_engine=engine)
    costs = CostModel(profile())
    counted = Simulation(topology, costs)
    assert isinstance(counted.decoders["decode-0"].engine.scheduler.pool, CountingPool)
    fast = counted.run(mixed_arrivals(), timeout=30)
    monkeypatch.setattr(simengine, "CountingPool", BlockPool)
    real = Simulation(topology, costs)
    assert type(real.decoders["decode-0"].engine.scheduler.pool) is BlockPool
    slow = real.run(mixed_arrivals(), timeout=30)
    assert [timeline(a) for a in fast] == [timeline(b) for b in slow]
    preempted = [
        sim.decoders["decode-0"].engine.scheduler.num_preemptions for sim in (counted, real)
    ]
    assert preempted[0] == preempted[1] > 0
