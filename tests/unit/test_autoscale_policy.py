"""The scaling policy replayed on metric series, one sample per second.

A toy cluster stands in for the backend: a role's load (running sequences, KV blocks in
use, the prefill queue) is shared evenly by its serving nodes, started nodes register
after a set delay, and removed nodes vanish. Series are synthetic levels with seeded noise,
so every run replays the same numbers and the times asserted are exact.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from tandem.autoscale.policy import Policy, PolicyConfig, choose_victims
from tandem.autoscale.types import Decision, NodeSample, Observation, RoleBounds

pytestmark = pytest.mark.unit

BLOCKS = 100  # KV blocks per node


@dataclass(frozen=True)
class Load:
    running: float = 0.0  # decode: running sequences, whole cluster
    kv_blocks: float = 0.0  # decode: KV blocks in use, whole cluster
    queue: int = 0  # prefill work queue
    ttft: float | None = None


@dataclass
class Cluster:
    decode: list[str]
    prefill: list[str]
    startup: float = 0.0  # seconds from scale-up to registration
    starting: list[tuple[float, str, str]] = field(default_factory=list)
    log: list[tuple[float, Decision]] = field(default_factory=list)
    made: int = 0

    @classmethod
    def of(cls, decode: int, prefill: int = 1, startup: float = 0.0) -> Cluster:
        return cls(
            [f"decode-{i}" for i in range(decode)],
            [f"prefill-{i}" for i in range(prefill)],
            startup,
            made=decode + prefill,
        )

    def nodes(self, role: str) -> list[str]:
        return self.decode if role == "decode" else self.prefill

    def current(self) -> dict[str, int]:
        # What a backend counts: registered nodes plus those started and still loading.
        return {
            role: len(self.nodes(role)) + sum(1 for s in self.starting if s[1] == role)
            for role in ("prefill", "decode")
        }

    def observation(self, t: float, load: Load) -> Observation:
        for entry in [s for s in self.starting if s[0] <= t]:
            self.starting.remove(entry)
            self.nodes(entry[1]).append(entry[2])
        samples = _share("decode", self.decode, load.running, load.kv_blocks)
        samples += _share("prefill", self.prefill, 0, 0)
        return Observation(t, samples, load.queue, load.ttft)

    def apply(self, t: float, decisions: list[Decision]) -> None:
        for d in decisions:
            self.log.append((t, d))
            if d.delta > 0:
                for _ in range(d.delta):
                    self.made += 1
                    self.starting.append((t + self.startup, d.role, f"{d.role}-{self.made}"))
            else:
                assert len(d.remove) == -d.delta
                for node_id in d.remove:
                    self.nodes(d.role).remove(node_id)


def _share(role: str, ids: list[str], running: float, blocks: float) -> list[NodeSample]:
    n = len(ids)
    out = []
    for i, node_id in enumerate(ids):
        # Integer shares that add up to the total: the first nodes take the remainder.
        r = int(running) // n + (1 if i < int(running) % n else 0)
        used = min(BLOCKS, round(blocks / n))
        out.append(NodeSample(node_id, role, r, BLOCKS - used, BLOCKS))
    return out


def replay(
    policy: Policy, cluster: Cluster, series: Callable[[int], Load], seconds: int
) -> list[tuple[float, Decision]]:
    for t in range(seconds):
        obs = cluster.observation(float(t), series(t))
        cluster.apply(float(t), policy.observe(obs, cluster.current()))
    return cluster.log


def times(log: list[tuple[float, Decision]], role: str = "decode") -> list[tuple[float, int]]:
    return [(t, d.delta) for t, d in log if d.role == role]


def noisy(level: float, spread: float, seed: int) -> Callable[[int], float]:
    """A level with uniform noise of ±spread, the same numbers for the same seed."""
    rng = random.Random(seed)
    values: dict[int, float] = {}

    def at(t: int) -> float:
        while len(values) <= t:
            values[len(values)] = max(0.0, level + rng.uniform(-spread, spread))
        return values[t]

    return at


# ---- decode ------------------------------------------------------------------------------


def test_spike_scales_decode_up_after_the_up_window() -> None:
    cluster = Cluster.of(decode=2)
    # 5 per node until t=10, then 12 per node: over the high threshold of 8.
    log = replay(Policy(), cluster, lambda t: Load(running=10 if t < 10 else 24), 14)
    assert times(log) == [(13.0, 1)]  # first over at 10, held for up_window (3 s)
    assert "12.0 running per node ≥ 8 (2 nodes)" in log[0][1].reason


def test_kv_use_alone_scales_decode_up() -> None:
    cluster = Cluster.of(decode=2)
    log = replay(Policy(), cluster, lambda t: Load(running=4, kv_blocks=170), 5)
    assert times(log) == [(3.0, 1)]
    assert "KV use 0.85 ≥ 0.80" in log[0][1].reason


def test_large_overload_takes_a_bigger_step_but_not_past_max_step() -> None:
    cluster = Cluster.of(decode=1)
    log = replay(Policy(), cluster, lambda t: Load(running=40), 4)
    assert times(log) == [(3.0, 2)]  # 5 nodes would be needed; max_step is 2


def test_single_tick_spikes_do_not_scale() -> None:
    cluster = Cluster.of(decode=2)
    # A spike every 7 s lasting one or two ticks (shorter than the up window).
    log = replay(Policy(), cluster, lambda t: Load(running=40 if t % 7 in (0, 1) else 8), 300)
    assert log == []


def test_sustained_low_load_scales_down_one_at_a_time_to_the_minimum() -> None:
    cluster = Cluster.of(decode=4)
    log = replay(Policy(), cluster, lambda t: Load(running=0), 200)
    # down_window is 20 s; the evidence restarts on the tick after each change.
    assert times(log) == [(20.0, -1), (41.0, -1), (62.0, -1)]
    assert len(cluster.decode) == 1


def test_scale_down_respects_the_cooldown() -> None:
    config = PolicyConfig(down_window=5, cooldown=10)
    cluster = Cluster.of(decode=4)
    log = replay(Policy(config), cluster, lambda t: Load(running=0), 100)
    # Held at 11 again, but the previous scale-down was at 5: waits until 15.
    assert times(log) == [(5.0, -1), (15.0, -1), (25.0, -1)]


def test_no_scale_down_soon_after_a_scale_up() -> None:
    config = PolicyConfig(down_window=5)
    cluster = Cluster.of(decode=2)
    # Load for 10 s (scale-up at 3), then idle: down_after_up (30 s) holds it until 33.
    log = replay(Policy(config), cluster, lambda t: Load(running=20 if t < 10 else 0), 40)
    assert times(log) == [(3.0, 1), (33.0, -1)]


def test_kv_use_keeps_a_node_that_running_counts_would_drop() -> None:
    cluster = Cluster.of(decode=2)
    # 30% of the blocks each: on one node that would be 60% > kv_used_low (50%).
    log = replay(Policy(), cluster, lambda t: Load(running=0, kv_blocks=60), 100)
    assert log == []


def test_noise_inside_the_hysteresis_band_changes_nothing() -> None:
    cluster = Cluster.of(decode=3)
    running = noisy(15, 7, seed=1)  # 2.7..7.3 per node; with 2 nodes 4..11 per node
    kv = noisy(90, 50, seed=2)  # 13%..47% in use; with 2 nodes 20%..70%
    log = replay(Policy(), cluster, lambda t: Load(running(t), kv(t)), 3000)
    assert log == []


def test_noise_around_the_high_threshold_scales_up_once_and_never_back() -> None:
    cluster = Cluster.of(decode=2)
    running = noisy(16, 6, seed=3)  # 5..11 per node on 2 nodes: over 8 about half the ticks
    log = replay(Policy(), cluster, lambda t: Load(running(t)), 3000)
    assert [d.delta for _, d in log] == [1]  # then 3.3..7.3 per node: inside the band


def test_noise_around_the_low_threshold_scales_down_at_most_once() -> None:
    cluster = Cluster.of(decode=3)
    running = noisy(4, 3, seed=4)  # with one node fewer: 0.5..3.5 per node around 2
    log = replay(Policy(), cluster, lambda t: Load(running(t)), 3000)
    assert [d.delta for _, d in log] in ([], [-1])


def test_load_swinging_across_both_thresholds_flaps_only_without_windows() -> None:
    # 0..10 per node on 2 nodes, a fresh draw every second: over the high threshold and
    # under the low one within seconds, over and over.
    naive = PolicyConfig(up_window=0, down_window=0, cooldown=0, down_after_up=0)
    flapping = replay(Policy(naive), Cluster.of(decode=2), _swinging(seed=7), 3000)
    assert len(flapping) > 500  # the series does flap a policy with thresholds alone
    log = replay(Policy(), Cluster.of(decode=2), _swinging(seed=7), 3000)
    assert [d.delta for _, d in log] == [1]


def _swinging(seed: int) -> Callable[[int], Load]:
    running = noisy(10, 10, seed)
    return lambda t: Load(running(t))


def test_bursty_load_scales_up_and_does_not_flap_between_bursts() -> None:
    cluster = Cluster.of(decode=1)
    rng = random.Random(5)
    # 6 s bursts every 15 s, idle in between: each idle stretch is shorter than down_window.
    bursts = [rng.uniform(20, 28) if t % 15 < 6 else rng.uniform(0, 2) for t in range(2000)]
    log = replay(Policy(), cluster, lambda t: Load(bursts[t]), 2000)
    deltas = [d.delta for _, d in log]
    assert deltas and all(delta > 0 for delta in deltas)
    assert len(cluster.decode) <= 4


def test_min_and_max_hold_under_random_load() -> None:
    bounds = {"decode": RoleBounds(min=2, max=5), "prefill": RoleBounds(min=1, max=3)}
    config = PolicyConfig(bounds=bounds, down_window=5, cooldown=2, down_after_up=5)
    cluster = Cluster.of(decode=2, prefill=1, startup=4)
    rng = random.Random(6)
    # Levels that jump every 30 s between idle and far over any threshold.
    levels = [rng.choice([0, 5, 60]) for _ in range(200)]
    series = [
        Load(levels[t // 30] * rng.uniform(0.8, 1.2), queue=int(levels[t // 30] // 3))
        for t in range(6000)
    ]
    policy = Policy(config)
    for t in range(6000):
        obs = cluster.observation(float(t), series[t])
        cluster.apply(float(t), policy.observe(obs, cluster.current()))
        now = cluster.current()
        assert 2 <= now["decode"] <= 5 and 1 <= now["prefill"] <= 3
    assert any(d.delta > 0 for _, d in cluster.log) and any(d.delta < 0 for _, d in cluster.log)


def test_below_minimum_scales_up_at_once_and_above_maximum_down() -> None:
    config = PolicyConfig(bounds={"decode": RoleBounds(min=2, max=3)})
    p = Policy(config)
    obs = Observation(0.0, _share("decode", ["decode-0"], 0, 0) + _share("prefill", ["p"], 0, 0))
    [d] = p.observe(obs, {"decode": 1, "prefill": 1})
    assert (d.role, d.delta, d.reason) == ("decode", 1, "decode: below minimum (1 < 2)")
    ids = [f"decode-{i}" for i in range(5)]
    obs = Observation(1.0, _share("decode", ids, 9, 0) + _share("prefill", ["p"], 0, 0))
    [d] = p.observe(obs, {"decode": 5, "prefill": 1})
    # Ignores the cooldown; the victims are the two with fewest running (ties: highest id).
    assert (d.delta, d.remove) == (-2, ("decode-4", "decode-3"))
    assert d.reason == "decode: above maximum (5 > 3)"


def test_never_scales_up_past_max() -> None:
    config = PolicyConfig(bounds={"decode": RoleBounds(min=1, max=3)})
    cluster = Cluster.of(decode=2)
    log = replay(Policy(config), cluster, lambda t: Load(running=100), 200)
    assert times(log) == [(3.0, 1)]
    assert len(cluster.decode) == 3


# ---- nodes still starting ----------------------------------------------------------------


def test_nodes_still_starting_suppress_a_second_scale_up() -> None:
    cluster = Cluster.of(decode=2, startup=60)
    # One node per step, so that the load still calls for more once the first one serves.
    log = replay(Policy(PolicyConfig(max_step=1)), cluster, lambda t: Load(running=40), 80)
    # The node asked for at 3 registers at 63; the load, still high, counts again from then.
    assert times(log) == [(3.0, 1), (66.0, 1)]


def test_a_node_that_never_registers_is_ignored_after_the_startup_grace() -> None:
    cluster = Cluster.of(decode=2, startup=10_000)
    log = replay(Policy(PolicyConfig(max_step=1)), cluster, lambda t: Load(running=40), 140)
    assert times(log) == [(3.0, 1), (126.0, 1)]  # grace over at 123, then up_window


# ---- prefill -----------------------------------------------------------------------------


def test_prefill_scales_up_on_queue_depth() -> None:
    cluster = Cluster.of(decode=1, prefill=1)
    log = replay(Policy(), cluster, lambda t: Load(running=5, queue=10 if t >= 5 else 0), 10)
    assert times(log, "prefill") == [(8.0, 2)]  # 10 queued need 3 nodes at 4 per node
    assert "queue 10 (10.0 per node) ≥ 4 per node" in log[0][1].reason


def test_prefill_scales_up_on_ttft() -> None:
    cluster = Cluster.of(decode=1, prefill=1)
    log = replay(Policy(), cluster, lambda t: Load(running=5, ttft=3.0 if t >= 5 else 0.3), 10)
    assert times(log, "prefill") == [(8.0, 1)]
    assert "TTFT p90 3.00s ≥ 2.00s" in log[0][1].reason


def test_prefill_scales_down_when_idle() -> None:
    cluster = Cluster.of(decode=1, prefill=3)
    log = replay(Policy(), cluster, lambda t: Load(running=5, ttft=None if t % 2 else 0.2), 50)
    assert times(log, "prefill") == [(20.0, -1), (41.0, -1)]
    assert log[0][1].remove == ("prefill-2",)  # all idle: the highest id goes first
    assert "queue empty" in log[0][1].reason


def test_prefill_stays_while_requests_queue() -> None:
    cluster = Cluster.of(decode=1, prefill=2)
    log = replay(Policy(), cluster, lambda t: Load(running=5, queue=1, ttft=0.2), 200)
    assert times(log, "prefill") == []


# ---- victims -----------------------------------------------------------------------------


def test_victim_is_the_node_with_fewest_running_ties_to_highest_id() -> None:
    nodes = [
        NodeSample("decode-a", "decode", 1, 90, 100),
        NodeSample("decode-b", "decode", 0, 90, 100),
        NodeSample("decode-c", "decode", 0, 90, 100),
        NodeSample("decode-d", "decode", 1, 90, 100),
    ]
    assert [v.node_id for v in choose_victims(nodes, 1)] == ["decode-c"]
    assert [v.node_id for v in choose_victims(nodes, 3)] == ["decode-c", "decode-b", "decode-d"]
    p = Policy(PolicyConfig(down_window=0))
    [d] = [d for d in p.observe(Observation(0.0, nodes), {"decode": 4}) if d.role == "decode"]
    assert d.remove == ("decode-c",)
    assert "with 3 nodes, 0.7 running per node ≤ 2 and KV use 0.13 ≤ 0.50" in d.reason


def test_draining_nodes_are_neither_serving_nor_victims() -> None:
    nodes = [
        NodeSample("decode-a", "decode", 3, 90, 100),
        NodeSample("decode-b", "decode", 0, 90, 100, draining=True),
    ]
    assert choose_victims(Observation(0.0, nodes).serving("decode"), 1)[0].node_id == "decode-a"


def test_thresholds_must_leave_a_band() -> None:
    with pytest.raises(ValueError, match="decode_running"):
        PolicyConfig(decode_running_low=8, decode_running_high=8)


def test_the_routers_ttft_histogram_is_read_over_every_model() -> None:
    """The router labels TTFT by model; the autoscaler's p90 is over all of them (the real
    router's metrics, two models observed)."""
    from prometheus_client import generate_latest

    from services.router.metrics import RouterMetrics
    from tandem.autoscale.controller import p90_between, ttft_buckets

    metrics = RouterMetrics()
    before = ttft_buckets(generate_latest(metrics.registry).decode())
    for _ in range(9):
        metrics.ttft.labels("a").observe(0.2)
    metrics.ttft.labels("b").observe(20.0)
    now = ttft_buckets(generate_latest(metrics.registry).decode())
    assert now[float("inf")] == 10  # both models' observations
    assert p90_between(before, now) == 0.25
    metrics.ttft.labels("b").observe(20.0)
    metrics.ttft.labels("b").observe(20.0)
    later = ttft_buckets(generate_latest(metrics.registry).decode())
    assert p90_between(before, later) == 30  # model b's slow first tokens count
