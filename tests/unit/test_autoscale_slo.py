"""The SLO policy (tandem/autoscale/slo.py) with the planner's real simulator on a profile
whose answers are known in closed form (tests/unit/test_plan_simulate.py's: a prompt token
costs 1 ms of one prefill node, a decode step 50 ms at any batch): how many prefill nodes a
load of 500-token prompts needs, the forecast of a ramp and of a drop, moves in replica
space without oscillating, the infeasible case, and the router's counts as the controller
reads them from a real router's metrics."""

from __future__ import annotations

import argparse
import gc
import math
from collections.abc import Mapping
from pathlib import Path

import msgspec
import pytest
from prometheus_client import generate_latest

from services.router.metrics import RouterMetrics
from tandem.autoscale.controller import router_counts
from tandem.autoscale.metrics import AutoscaleMetrics
from tandem.autoscale.options import add_policy_options, scaled_nodes_problem, slo_problem
from tandem.autoscale.policies import policy_from_args
from tandem.autoscale.sizer import Load, Size, Sizer
from tandem.autoscale.slo import SloPolicy
from tandem.autoscale.types import (
    Decision,
    NodeSample,
    Observation,
    RoleBounds,
    RouterCounts,
    Slo,
    SloConfig,
)
from tests.unit.test_plan_simulate import profile

pytestmark = pytest.mark.unit

PROMPT, OUTPUT = 500, 32  # a prompt takes one prefill node 0.5 s: 2 req/s a node at most
SLO = Slo(ttft=4.0, tpot=0.2, attainment=0.99)
BOUNDS = {"prefill": RoleBounds(1, 4), "decode": RoleBounds(1, 2)}


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("slo") / "profile.json"
    path.write_bytes(msgspec.json.encode(profile()))
    return str(path)


@pytest.fixture(scope="module")
def sizer(profile_path: str) -> Sizer:
    return Sizer(profile_path, SLO, BOUNDS)


def load(rate: float) -> Load:
    return Load(rate, PROMPT, OUTPUT)


def test_the_planner_sizes_prefill_nodes_by_the_load(sizer: Sizer) -> None:
    light, heavy = sizer.size(load(0.5)), sizer.size(load(5.0))
    assert (light.prefill, light.decode, light.feasible) == (1, 1, True)
    assert heavy.feasible and heavy.prefill >= 3  # 2.5 s of prefill a second
    assert sizer.attainment(load(5.0), 1, 1) < SLO.attainment  # one node falls behind
    too_much = sizer.size(load(12.0))  # 6 s of prefill a second: more than 4 nodes have
    assert not too_much.feasible and (too_much.prefill, too_much.decode) == (4, 2)
    runs = sizer.simulations
    assert sizer.size(load(5.05)) is sizer.size(load(5.0))  # within a step: cached
    assert sizer.simulations == runs


def test_with_a_conditional_router_no_prefill_node_is_a_size(profile_path: str) -> None:
    """`--conditional --prefill-min 0`: decode nodes prefill while no prefill node is up,
    so the planner weighs running without the pool (colocated) against with it: none at
    a light load, a pool at a heavy one, where the split router needs a node always."""
    bounds = {"prefill": RoleBounds(0, 4), "decode": RoleBounds(1, 2)}
    sizer = Sizer(profile_path, SLO, bounds, ["--conditional"])
    light, heavy = sizer.size(load(0.5)), sizer.size(load(5.0))
    assert (light.prefill, light.decode, light.feasible) == (0, 1, True)
    assert heavy.feasible and heavy.prefill >= 3  # 2.5 s of prefill a second
    assert sizer.attainment(load(5.0), 0, 2) < SLO.attainment  # decode nodes alone fall behind
    args = parse("--prefill-min", "0")
    with pytest.raises(SystemExit, match="conditional"):
        policy_from_args(args)  # a split router has nowhere to prefill without the pool
    assert policy_from_args(args, ["--conditional"]).config.bounds["prefill"].min == 0
    conditional = argparse.Namespace(**vars(args), conditional=True)  # tandem up's flag
    assert policy_from_args(conditional).config.bounds["prefill"].min == 0
    assert "--conditional" in (scaled_nodes_problem(args) or "")  # before a stack starts
    assert scaled_nodes_problem(conditional) is None
    assert scaled_nodes_problem(parse()) is None
    assert "--decode-min" in (scaled_nodes_problem(parse("--decode-min", "0")) or "")


def test_a_load_is_simulated_with_the_mean_and_variance_it_was_measured_with() -> None:
    """Lengths as the sizer simulates them keep the observed mean and variance: a uniform
    where one fits from 1 up, else two lengths (a short/long mix); a uniform cut at 1
    raised the mean of a half-long mix from 800 to 1,006 tokens."""
    from tandem.bench.workload import parse_lengths

    def moments(spec: str) -> tuple[float, float]:
        d = parse_lengths(spec)
        if d.kind == "uniform":
            n = d.high - d.low + 1
            return (d.low + d.high) / 2, (n * n - 1) / 12
        if d.kind == "mix":
            mean = d.low + d.fraction * (d.high - d.low)
            return mean, d.fraction * (1 - d.fraction) * (d.high - d.low) ** 2
        return d.low, 0.0

    # (mean, sigma): a wide uniform, a 20% and a 50% mix of 100 and 1,500 tokens, alike
    for mean, sigma in ((1100, 520), (380, 560), (800, 700), (32, 0)):
        spread = round(math.sqrt(3) * sigma)
        prompt, _ = Load(1.0, mean, 8, spread, 0).lengths()
        got_mean, got_var = moments(prompt)
        assert got_mean == pytest.approx(mean, rel=0.01), prompt
        assert got_var == pytest.approx(sigma * sigma, rel=0.02, abs=1), prompt
    assert Load(1.0, 1100, 8, 900, 0).lengths()[0] == "uniform:200:2000"


def ramp_config(interval: float = 0.0, bounds: dict[str, RoleBounds] = BOUNDS) -> SloConfig:
    """The timings the ramp tests run with: a 30 s window, a node's start of 20 s."""
    return SloConfig(window=30, min_span=10, horizon=20, headroom=0.2, up_window=2,
                     down_window=30, down_after_up=30, interval=interval,
                     bounds=bounds)  # fmt: skip


def observe_rates(
    policy: SloPolicy, rates: list[float], current: dict[str, int], start: float = 0.0
) -> list[tuple[float, Decision]]:
    """One observation a second at each rate in turn; decisions are applied at once (the
    nodes start serving immediately)."""
    out = []
    requests = 0.0
    for i, rate in enumerate(rates):
        now = start + i
        requests += rate
        nodes = [NodeSample(f"{role}-{k}", role) for role, n in current.items() for k in range(n)]
        counts = RouterCounts(requests, requests * PROMPT, requests * OUTPUT, requests)
        for d in policy.observe(Observation(now, nodes, router=counts), dict(current)):
            current[d.role] += d.delta
            out.append((now, d))
    return out


def test_a_ramp_scales_up_ahead_and_a_drop_scales_down_one_node_at_a_time(sizer: Sizer) -> None:
    config = ramp_config()
    policy = SloPolicy(sizer, config)
    current = {"prefill": 1, "decode": 1}
    # 60 s at 0.5 req/s, a 60 s ramp to 4 req/s, 120 s there, then 0.5 req/s for 240 s
    rates = [0.5] * 60 + [0.5 + 3.5 * k / 60 for k in range(60)] + [4.0] * 120 + [0.5] * 240
    moves = observe_rates(policy, rates, current)
    ups = [(t, d) for t, d in moves if d.delta > 0]
    downs = [(t, d) for t, d in moves if d.delta < 0]
    assert all(d.role == "prefill" for _, d in moves), moves  # decode is never short here
    assert ups and all(60 <= t < 120 for t, _ in ups), ups  # during the ramp, ahead of it
    peak = 1 + sum(d.delta for _, d in ups)
    assert peak >= 3
    assert all(d.delta == -1 and len(d.remove) == 1 for _, d in downs)
    assert current["prefill"] == 1  # back to one once the load is down
    assert all(t >= 240 + config.down_window for t, _ in downs)  # only after the window
    assert len(moves) <= 8, moves  # a few moves, no oscillation
    assert "planner sizes" in ups[0][1].reason


def test_an_interval_moves_in_fewer_larger_steps(sizer: Sizer) -> None:
    """`interval`: a size planned to hold that long. The ramp is met as far ahead (no
    later move than without it, the trend read over the interval), and the drop takes
    every spare node of a role in one decision where one node at a time took several
    (a steep ramp extrapolated that far overshoots: the price is node-seconds)."""
    rates = [0.5] * 60 + [0.5 + 3.5 * k / 60 for k in range(60)] + [4.0] * 120 + [0.5] * 240
    runs = {}
    for interval in (0.0, 120.0):
        current = {"prefill": 1, "decode": 1}
        policy = SloPolicy(sizer, ramp_config(interval))
        runs[interval] = (observe_rates(policy, rates, current), current)
    (steady, _), (planned, current) = runs[0.0], runs[120.0]
    downs = [d for _, d in planned if d.delta < 0]
    assert len({d.role for d in downs}) == len(downs), planned  # once a role
    assert any(d.delta <= -2 for d in downs), planned  # every spare node at once
    assert all(len(d.remove) == -d.delta for d in downs)
    assert current == {"prefill": 1, "decode": 1}
    prefill_downs = [d for _, d in steady if d.delta < 0 and d.role == "prefill"]
    assert len(prefill_downs) >= 2 and all(d.delta == -1 for d in prefill_downs)
    assert len([d for d in downs if d.role == "prefill"]) == 1  # where one at a time took 2+
    first_up = min(t for t, d in planned if d.delta > 0)
    assert first_up <= min(t for t, d in steady if d.delta > 0)
    peak = 1 + sum(d.delta for _, d in planned if d.delta > 0)
    assert peak >= 1 + sum(d.delta for _, d in steady if d.delta > 0)


class LinearSizer(Sizer):
    """A prefill node per 0.5 req/s, one decode node: a stand-in for the planner (the real
    Sizer is tested above) where a long ramp needs many nodes."""

    def __init__(self, bounds: dict[str, RoleBounds]) -> None:
        self.slo, self.bounds = SLO, bounds

    def size(self, load: Load, last: Size | None = None) -> Size:
        cap = self.bounds["prefill"].max
        return Size(min(max(math.ceil(load.rate / 0.5), 1), cap), 1, 1.0, True)


def test_an_interval_plans_a_long_ramp_in_a_few_changes() -> None:
    """A 400 s ramp to 12 nodes and back: one node at a time takes a change per node each
    way; a size planned to hold 240 s (the trend read over 240 s, the forecast that far
    ahead, a scale-up within the interval only when the load outruns what the last change
    planned for, every spare node removed at once) takes under a third of them, and the
    deployment is never below the load's need in either."""
    wide = {"prefill": RoleBounds(1, 16), "decode": RoleBounds(1, 1)}
    ramp = [0.5 + 5.5 * k / 400 for k in range(400)]
    rates = [0.5] * 60 + ramp + [6.0] * 100 + ramp[::-1] + [0.5] * 200
    runs = {}
    for interval in (0.0, 240.0):
        current = {"prefill": 1, "decode": 1}
        policy = SloPolicy(LinearSizer(wide), ramp_config(interval, wide))
        moves = observe_rates(policy, rates, current)
        assert current["prefill"] == 2, moves  # 0.5 req/s with the headroom: 2 nodes
        count, deltas = 1, dict.fromkeys(range(len(rates)), 0)
        for t, d in moves:
            deltas[int(t)] += d.delta
        for t, rate in enumerate(rates):
            count += deltas[t]
            assert count >= math.ceil(rate / 0.5), (interval, t, moves)
        runs[interval] = moves
    assert len(runs[0.0]) >= 20, runs[0.0]  # a node at a time, up and down
    assert len(runs[240.0]) * 3 < len(runs[0.0]), runs[240.0]


def test_a_tick_where_no_role_can_move_sizes_nothing() -> None:
    """Within an interval no role moves unless the load outruns its last plan, and a
    scale-down at the interval's end needs only its last down window sized: the ticks
    before it size nothing, and every decision is what sizing every tick decides."""
    wide = {"prefill": RoleBounds(1, 16), "decode": RoleBounds(1, 1)}
    ramp = [0.5 + 5.5 * k / 400 for k in range(400)]
    rates = [0.5] * 60 + ramp + [6.0] * 100 + ramp[::-1] + [0.5] * 200

    class Counting(LinearSizer):
        asked = 0

        def size(self, load: Load, last: Size | None = None) -> Size:
            Counting.asked += 1
            return super().size(load, last)

    class EveryTick(SloPolicy):
        def _held(self, now: float, current: Mapping[str, int], near: float) -> bool:
            return False

    runs, asked = [], []
    for kind in (SloPolicy, EveryTick):
        Counting.asked = 0
        policy = kind(Counting(wide), ramp_config(240.0, wide))
        runs.append(observe_rates(policy, rates, {"prefill": 1, "decode": 1}))
        asked.append(Counting.asked)
    assert runs[0] == runs[1] and len(runs[0]) >= 3
    assert asked[0] < asked[1] / 2, asked


def test_a_deployed_split_that_ties_with_the_size_is_kept() -> None:
    """Splits of one total tie when both meet the SLO: the one deployed stays (the search
    may find the other first, and a deployment flipped between them, a node started and
    another drained each time); one that misses the SLO does not."""
    bounds = {"prefill": RoleBounds(0, 4), "decode": RoleBounds(1, 4)}
    meets = {(0, 3), (2, 1), (1, 3)}

    class Ties(LinearSizer):
        def size(self, load: Load, last: Size | None = None) -> Size:
            return Size(2, 1, 1.0, True)

        def attainment(self, load: Load, prefill: int, decode: int) -> float:
            return 1.0 if (prefill, decode) in meets else 0.5

    def decisions(current: dict[str, int]) -> list[Decision]:
        policy = SloPolicy(Ties(bounds), ramp_config(0.0, bounds))
        moves = observe_rates(policy, [0.5] * 200, current)
        return [d for _, d in moves]

    assert decisions({"prefill": 0, "decode": 3}) == []  # 0P+3D meets it: kept
    moved = decisions({"prefill": 1, "decode": 2})  # 1P+2D misses it: to 2P+1D
    assert [(d.role, d.delta) for d in moved] == [("prefill", 1), ("decode", -1)], moved


def test_the_search_finds_what_trying_every_split_finds(profile_path: str) -> None:
    """Bisection per role, then a walk up from the two least counts: the deployment that
    trying every split of every total in turn finds (the fewest nodes, then the best
    attainment), in fewer simulations."""
    wide = {"prefill": RoleBounds(1, 8), "decode": RoleBounds(1, 3)}
    fast = Sizer(profile_path, SLO, wide)
    for rate in (0.5, 3.0, 5.0, 9.0):
        got = fast.size(load(rate))
        every = [
            (p + d, -fast.attainment(load(rate), p, d), p, d)
            for p in range(1, 9)
            for d in range(1, 4)
            if fast.attainment(load(rate), p, d) >= SLO.attainment
        ]
        _, _, p, d = min(every)
        assert (got.prefill, got.decode, got.feasible) == (p, d, True), rate
    searched = Sizer(profile_path, SLO, wide)
    searched.size(load(9.0))
    assert searched.simulations < 8 * 3 // 2
    # between two loads that need the same deployment, and past an infeasible one: known
    low, high = searched.size(load(0.5)), searched.size(load(0.9))
    assert (low.prefill, low.decode) == (high.prefill, high.decode)
    runs = searched.simulations
    middle = searched.size(load(0.7))
    assert (middle.prefill, middle.decode, middle.feasible) == (low.prefill, low.decode, True)
    assert searched.simulations == runs
    assert not searched.size(load(30.0)).feasible
    runs = searched.simulations
    assert not searched.size(load(40.0)).feasible
    assert searched.simulations == runs


def test_a_size_is_searched_from_the_last_one_in_fewer_simulations(profile_path: str) -> None:
    """From the last tick's size, the next load's: the same answer as the search from
    the bounds, in a simulation or three (a drifting mix made nearly every tick a new
    load, and a simulated hour of a 64-node cluster spent an hour sizing)."""
    wide = {"prefill": RoleBounds(1, 8), "decode": RoleBounds(1, 3)}
    cold, warm = Sizer(profile_path, SLO, wide), Sizer(profile_path, SLO, wide)
    last = warm.size(load(3.0))
    for rate in (3.3, 3.8, 4.4, 5.2, 4.6, 3.9):  # up, then down again
        runs = warm.simulations
        got = warm.size(load(rate), last)
        assert warm.simulations - runs <= 4, rate
        want = cold.size(load(rate))
        assert (got.prefill, got.decode, got.feasible) == (want.prefill, want.decode, True)
        last = got
    assert warm.simulations < cold.simulations


def test_sizing_inside_a_simulation_frees_its_own(sizer: Sizer) -> None:
    """`tandem plan simulate --autoscale` sizes from inside a simulation that pauses the
    cyclic collector: the Sizer's simulations must not outlive their answer (they did,
    ~30 MB each, until a simulated hour of a large cluster ran out of memory)."""
    from shared.runtime.collector import collector_paused
    from tandem.plan.simulator import Simulation

    gc.collect()  # what earlier tests left
    with collector_paused():
        for rate in (1.1, 2.3, 3.7):
            sizer.attainment(load(rate), 2, 1)
        alive = [o for o in gc.get_objects() if type(o) is Simulation]
    assert alive == []


def test_a_recorded_series_replays_to_the_same_decisions(profile_path: str) -> None:
    """The policy takes time only from the observations and its simulations are seeded:
    the observations of a run, fed again to a fresh policy and sizer, give the very same
    decisions (a recorded incident can be replayed)."""
    config = ramp_config()
    recorded: list[tuple[Observation, dict[str, int]]] = []

    class Recording(SloPolicy):
        def observe(self, obs: Observation, current: Mapping[str, int]) -> list[Decision]:
            recorded.append((obs, dict(current)))
            return super().observe(obs, current)

    rates = [0.5] * 30 + [0.5 + 3.5 * k / 40 for k in range(40)] + [4.0] * 60 + [0.5] * 120
    first = observe_rates(Recording(Sizer(profile_path, SLO, BOUNDS), config), rates,
                          {"prefill": 1, "decode": 1})  # fmt: skip
    again = SloPolicy(Sizer(profile_path, SLO, BOUNDS), config)
    replayed = [(obs.time, d) for obs, current in recorded for d in again.observe(obs, current)]
    assert first and replayed == first


def test_a_backlog_beyond_the_rate_is_sized_to_drain_within_the_horizon(sizer: Sizer) -> None:
    """Behind after a fast ramp, a deployment that matches the arrival rate stays behind:
    the jobs queued beyond what the rate explains at the TTFT target are added as the rate
    that drains them within the horizon."""
    cfg = SloConfig(window=20, min_span=5, horizon=20, headroom=0.0, bounds=BOUNDS)
    sizes = {}
    for queued in (2, 60):  # 2: what 1 req/s explains at a 4 s target; 60: behind
        policy = SloPolicy(sizer, cfg)
        nodes = [NodeSample("prefill-0", "prefill"), NodeSample("decode-0", "decode")]
        for t in range(21):
            counts = RouterCounts(t, t * PROMPT, t * OUTPUT, t)
            obs = Observation(float(t), nodes, prefill_queue=queued, router=counts)
            policy.observe(obs, {"prefill": 1, "decode": 1})
        assert policy.load is not None and policy.size is not None
        sizes[queued] = (policy.load.rate, policy.size.prefill)
    assert sizes[2] == (pytest.approx(1.0), 1)
    assert sizes[60][0] == pytest.approx(1.0 + (60 - 4) / 20)
    assert sizes[60][1] >= 2


def test_no_move_before_the_window_holds_a_rate_nor_after_a_router_restart(
    sizer: Sizer,
) -> None:
    policy = SloPolicy(sizer, SloConfig(window=30, min_span=10, bounds=BOUNDS))
    current = {"prefill": 1, "decode": 1}
    nodes = [NodeSample("prefill-0", "prefill"), NodeSample("decode-0", "decode")]
    moves = observe_rates(policy, [6.0] * 16, current)
    assert moves and min(t for t, _ in moves) >= 10  # cold: no rate before 10 s of counts
    for t in (16.0, 19.0):  # 1P+1D is short of what it sized, past the up window
        unread = Observation(t, nodes, router=None)
        assert policy.observe(unread, {"prefill": 1, "decode": 1}) == []  # not unread ticks
    # the router restarts: its counters begin again, and so does the window
    policy.observe(Observation(100.0, nodes, router=RouterCounts(1, PROMPT, OUTPUT, 1)), current)
    assert policy.forecast() is None


def test_an_infeasible_slo_holds_the_maximum_and_says_so(sizer: Sizer) -> None:
    policy = SloPolicy(sizer, SloConfig(window=20, min_span=5, up_window=0, bounds=BOUNDS))
    current = {"prefill": 1, "decode": 1}
    moves = observe_rates(policy, [12.0] * 40, current)
    assert current == {"prefill": 4, "decode": 2}
    assert policy.infeasible and "at the maximum" in policy.why
    assert len(moves) == 2  # one move a role, then it holds
    assert "infeasible" in moves[0][1].reason
    # and the autoscaler's /metrics says so (the controller passes the policy's word on)
    metrics = AutoscaleMetrics()
    metrics.tick("m", current, [d for _, d in moves], policy.infeasible, policy.load.rate)
    text = generate_latest(metrics.registry).decode()
    assert 'tandem_autoscale_slo_infeasible{pool="m"} 1.0' in text
    assert 'tandem_autoscale_replicas{pool="m",role="prefill"} 4.0' in text
    assert 'tandem_autoscale_decisions_total{direction="up",pool="m",role="decode"} 1.0' in text


def test_infeasible_is_said_once_and_cleared_only_after_feasible_sizes_hold(
    sizer: Sizer,
) -> None:
    """At a peak the backlog term pushed the planned rate past the maximum and back within
    a tick, and the flag (a log line each change) flapped several times a minute."""
    cfg = SloConfig(window=20, min_span=5, up_window=0, down_window=30, bounds=BOUNDS)
    policy = SloPolicy(sizer, cfg)
    current = {"prefill": 1, "decode": 1}
    flags, sizes = [], []
    rates = [12.0] * 40 + [1.0] * 80
    requests = 0.0
    for now, rate in enumerate(rates):
        requests += rate
        nodes = [NodeSample(f"{role}-{k}", role) for role, n in current.items() for k in range(n)]
        counts = RouterCounts(requests, requests * PROMPT, requests * OUTPUT, requests)
        for d in policy.observe(Observation(float(now), nodes, router=counts), dict(current)):
            current[d.role] += d.delta
        flags.append(policy.infeasible)
        sizes.append(policy.size is not None and policy.size.feasible)
    changes = [t for t in range(1, len(flags)) if flags[t] != flags[t - 1]]
    assert len(changes) == 2 and flags[changes[0]] and not flags[-1]  # on, then off once
    feasible_from = next(t for t in range(40, len(sizes)) if all(sizes[t:]))
    assert changes[1] - feasible_from == cfg.down_window


def test_the_forecast_leads_a_ramp_and_trails_a_drop(sizer: Sizer) -> None:
    """A trend counts only beyond Poisson noise: a steady rate is not extrapolated."""
    cfg = SloConfig(window=20, min_span=5, horizon=10, headroom=0.0, bounds=BOUNDS)
    ramp, drop = SloPolicy(sizer, cfg), SloPolicy(sizer, cfg)
    observe_rates(ramp, [1.0 + 0.5 * k for k in range(21)], {"prefill": 4, "decode": 2})
    observe_rates(drop, [3.0] * 10 + [1.0] * 11, {"prefill": 4, "decode": 2})
    up, down = ramp.forecast(), drop.forecast()
    assert up is not None and up.rate > 11.0  # above the last rate seen (10.5-11)
    assert down is not None and down.rate == pytest.approx(1.0, abs=0.15)  # not below it
    assert (up.prompt_tokens, up.output_tokens) == (PROMPT, OUTPUT)
    steady = SloPolicy(sizer, cfg)
    observe_rates(steady, [3.0, 3.6, 2.4] * 7, {"prefill": 4, "decode": 2})
    level = steady.forecast()
    assert level is not None and level.rate == pytest.approx(3.0, abs=0.4)


def test_the_controller_reads_the_router_counts_from_its_metrics() -> None:
    m = RouterMetrics()
    for model, ttft in (("a", 0.2), ("a", 0.4), ("b", 1.0)):
        m.ttft.labels(model=model).observe(ttft)
    m.prompt_tokens.labels(model="a").inc(300)
    m.output_tokens.labels(model="a").inc(40)
    m.prompt_tokens_sq.labels(model="a").inc(100**2 + 200**2)
    m.output_tokens_sq.labels(model="a").inc(10**2 + 30**2)
    m.prompt_tokens.labels(model="b").inc(7)
    m.prompt_tokens_sq.labels(model="b").inc(49)
    m.routes.labels("remote", "a").inc(4)  # admitted: two still without a first token
    m.routes.labels("local", "a").inc(1)
    m.routes.labels("remote", "b").inc(1)
    text = generate_latest(m.registry).decode()
    assert router_counts(text, "a") == RouterCounts(2, 300, 40, 5, 50_000, 1_000)
    assert router_counts(text) == RouterCounts(3, 307, 40, 6, 50_049, 1_000)


def test_the_rate_is_of_arrivals_not_of_first_tokens(sizer: Sizer) -> None:
    """An overloaded deployment gives first tokens at its own capacity, whatever arrives:
    sized from those, the policy saw its load fall as it fell behind, and scaled down at
    the peak (a simulated day did). Arrivals rise; so does the forecast."""
    cfg = SloConfig(window=20, min_span=5, horizon=0, headroom=0.0, bounds=BOUNDS)
    policy = SloPolicy(sizer, cfg)
    nodes = [NodeSample("prefill-0", "prefill"), NodeSample("decode-0", "decode")]
    for t in range(21):  # 6 req/s arrive, 2 a second get their first token
        counts = RouterCounts(2.0 * t, 2.0 * t * PROMPT, 2.0 * t * OUTPUT, 6.0 * t)
        policy.observe(Observation(float(t), nodes, router=counts), {"prefill": 1, "decode": 1})
    load = policy.forecast()
    assert load is not None and load.rate == pytest.approx(6.0)
    assert (load.prompt_tokens, load.output_tokens) == (PROMPT, OUTPUT)
    assert policy.size is not None and policy.size.prefill >= 3
    # nothing served for a whole window: the lengths last known still size the arrivals
    for t in range(21, 45):
        counts = RouterCounts(40.0, 40.0 * PROMPT, 40.0 * OUTPUT, 6.0 * t)
        policy.observe(Observation(float(t), nodes, router=counts), {"prefill": 1, "decode": 1})
    stalled = policy.forecast()
    assert stalled is not None and stalled.rate == pytest.approx(6.0)
    assert stalled.prompt_tokens == PROMPT


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_policy_options(p)
    return p.parse_args(list(argv))


def test_the_slo_options(profile_path: str) -> None:
    assert slo_problem(parse()) is None  # the threshold policy needs none of them
    assert "--slo-ttft" in (slo_problem(parse("--policy", "slo")) or "")
    need = slo_problem(parse("--policy", "slo", "--slo-ttft", "2", "--slo-tpot", "0.1"))
    assert need is not None and "profile" in need
    args = parse("--policy", "slo", "--slo-ttft", "2", "--slo-tpot", "0.1",
                 "--scale-profile", profile_path)  # fmt: skip
    assert slo_problem(args) is None
    assert isinstance(policy_from_args(args), SloPolicy)
    with pytest.raises(SystemExit, match="headroom"):
        policy_from_args(parse(*vars_argv(args), "--headroom", "-1"))


def vars_argv(args: argparse.Namespace) -> list[str]:
    return ["--policy", "slo", "--slo-ttft", "2", "--slo-tpot", "0.1",
            "--scale-profile", str(Path(args.scale_profile))]  # fmt: skip


def test_tandem_up_sizes_with_its_profile_and_refuses_a_policy_without_targets(
    profile_path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from tandem.cli import build_parser
    from tandem.mode import prepare_slo_scaling
    from tandem.up import run as up

    argv = ["up", "--split", "--autoscale", "--policy", "slo", "--slo-ttft", "2", "--slo-tpot",
            "0.1", "--profile", profile_path, "--transport", "tcp"]  # fmt: skip
    args = build_parser().parse_args(argv)
    prepare_slo_scaling(args)
    assert args.scale_profile == profile_path  # the stack's own profile
    assert args.scale_node_options[:2] == ["--transport", "tcp"]
    policy = policy_from_args(args, args.scale_node_options)
    assert isinstance(policy, SloPolicy) and policy.config.down_window == SloConfig.down_window
    bare = build_parser().parse_args(["up", "--split", "--autoscale", "--policy", "slo"])
    assert up(bare) == 2  # nothing started
    assert "--slo-ttft and --slo-tpot" in capsys.readouterr().err


def test_the_spread_of_the_lengths_is_read_and_sized_with(sizer: Sizer) -> None:
    """Half the prompts 100 tokens, half 900: the load is 500 +- 693 (a uniform of the
    same variance), simulated with that mean and variance (wider than a uniform from 1:
    two lengths). On the H100 projection, prompts of 200-3,456
    tokens on 8P+4D met the SLO for 51% where prompts of their mean length met it for
    99.9%: the sizer must see the spread."""
    cfg = SloConfig(window=20, min_span=5, horizon=0, headroom=0.0, bounds=BOUNDS)
    policy = SloPolicy(sizer, cfg)
    nodes = [NodeSample("prefill-0", "prefill"), NodeSample("decode-0", "decode")]
    for t in range(21):  # 2 requests a second: one of 100 prompt tokens, one of 900
        counts = RouterCounts(2.0 * t, 1000.0 * t, 64.0 * t, 2.0 * t,
                              (100**2 + 900**2) * t, 2 * 32**2 * t)  # fmt: skip
        policy.observe(Observation(float(t), nodes, router=counts), {"prefill": 4, "decode": 2})
    load = policy.forecast()
    assert load is not None
    assert (load.prompt_tokens, load.output_tokens, load.output_spread) == (500, 32, 0)
    assert load.prompt_spread == round(400 * 3**0.5)
    assert load.lengths() == ("mix:1:821:0.6087", "32")  # 1 or 821 tokens: 500 +- 400
    assert load.key() != Load(load.rate, 500, 32).key()  # sized apart from the mean alone
    # a wider spread fills the queue in bursts: more nodes for the same mean, or as many
    alike, spread = Load(3.0, PROMPT, OUTPUT), Load(3.0, PROMPT, OUTPUT, PROMPT - 1)
    assert sizer.attainment(spread, 2, 1) < sizer.attainment(alike, 2, 1)


def test_a_size_that_grows_while_nodes_load_is_asked_for_at_once(sizer: Sizer) -> None:
    """The nodes still loading count toward the size (not asked for twice), and a ramp
    that outgrows them is not kept waiting for them to come up: on a simulated H100 day,
    one scale-up a minute (a node's start) fell behind the morning."""
    cfg = SloConfig(window=20, min_span=5, horizon=10, headroom=0.0, up_window=0,
                    bounds=BOUNDS)  # fmt: skip
    policy = SloPolicy(sizer, cfg)
    serving = [NodeSample("prefill-0", "prefill"), NodeSample("decode-0", "decode")]
    current = {"prefill": 1, "decode": 1}  # nodes started count; only the first serve
    moves: list[tuple[int, int]] = []
    requests = 0.0
    for t in range(60):
        requests += 0.5 if t < 20 else 0.5 + 0.2 * (t - 20)  # a ramp from t = 20
        counts = RouterCounts(requests, requests * PROMPT, requests * OUTPUT, requests)
        for d in policy.observe(Observation(float(t), serving, router=counts), dict(current)):
            current[d.role] += d.delta
            moves.append((t, d.delta))
    assert len(moves) >= 2 and current["prefill"] >= 3, moves  # more asked as it grew
    assert sum(delta for _, delta in moves) == current["prefill"] - 1  # none asked twice
