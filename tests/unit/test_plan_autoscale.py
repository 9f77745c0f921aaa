"""`tandem plan simulate --autoscale` (tandem/plan/autoscale_sim.py, simscale.py): rate
curves and their arrivals, and the autoscaler's own policies over a simulated cluster on
tests/unit/test_plan_simulate.py's closed-form profile (a prompt token costs 1 ms of one
prefill node): a ramp, a plateau and a drop of 500-token prompts, which the SLO policy
meets with fewer node-seconds than the smallest fixed deployment that meets it, where the
threshold policy misses it, in a few replica changes, draining nodes without failing a
request."""

from __future__ import annotations

import json
import math
from pathlib import Path

import msgspec
import pytest

from tandem.bench.workload import parse_lengths
from tandem.cli import build_parser
from tandem.plan import autoscale_sim
from tandem.plan.autoscale_sim import RateCurve, arrivals
from tests.unit.test_plan_simulate import profile

pytestmark = pytest.mark.unit

CURVE = "0:0.5,300:4,600:4,900:0.5,1500:0.5"  # a ramp, a plateau, a drop
SLO = ["--slo-ttft", "4", "--slo-tpot", "0.2", "--slo-attainment", "0.99"]


def test_a_rate_curve_is_linear_between_its_points_and_a_diurnal_one_a_sine() -> None:
    curve = RateCurve.parse(CURVE, 1500)
    assert [curve.rate(t) for t in (0, 150, 300, 450, 750, 2000)] == [
        0.5, 2.25, 4, 4, 2.25, 0.5,
    ]  # fmt: skip
    day = RateCurve.parse("diurnal:10:2:86400", 86400)
    assert day.rate(0) == pytest.approx(2) and day.rate(43200) == pytest.approx(10, rel=0.01)
    for bad in ("1:2,0:3", "0:-1", "x", "diurnal:1:2:3", "diurnal:5:1:0"):
        with pytest.raises(ValueError):
            RateCurve.parse(bad, 100)


def test_arrivals_follow_the_curve_and_the_mix_shifts() -> None:
    curve = RateCurve.parse("0:1,1000:9", 1000)  # 5,000 expected
    lengths = (parse_lengths("100"), parse_lengths("10"))
    shifted = (parse_lengths("900"), parse_lengths("10"))
    got = arrivals(curve, 1000, lengths, shifted, seed=3)
    assert abs(len(got) - 5000) < 4 * math.sqrt(5000)
    early = [a for a in got if a.at < 500]
    late = [a for a in got if a.at >= 500]
    assert 0.16 < len(early) / len(got) < 0.34  # a quarter of the integral
    share = [sum(a.prompt_tokens == 900 for a in part) / len(part) for part in (early, late)]
    assert share[0] < 0.35 < 0.6 < share[1]  # mostly the first mix, then mostly the second
    assert arrivals(curve, 1000, lengths, shifted, seed=3) == got  # seeded


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("plan-autoscale") / "profile.json"
    path.write_bytes(msgspec.json.encode(profile()))
    return str(path)


def simulate(profile_path: str, out: Path, *extra: str) -> dict:  # type: ignore[type-arg]
    argv = ["plan", "simulate", "--profile", profile_path, "--quiet", "--prompt-len", "500",
            "--output-len", "32", *SLO, "--output", str(out), *extra]  # fmt: skip
    args = build_parser().parse_args(argv)
    assert args.func(args) == 0
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def scaled(profile_path: str, tmp_path: Path, policy: str) -> dict:  # type: ignore[type-arg]
    return simulate(
        profile_path, tmp_path / f"{policy}.json",
        "--prefill", "1", "--decode", "1", "--autoscale", policy, "--rate-curve", CURVE,
        "--curve-duration", "1500", "--prefill-max", "4", "--decode-max", "2",
        "--node-start", "20", "--seed", "1", "--plot", str(tmp_path / f"{policy}.png"),
    )  # fmt: skip


def test_the_slo_policy_meets_the_slo_with_fewer_node_seconds_than_a_fixed_deployment(
    profile_path: str, tmp_path: Path
) -> None:
    slo = scaled(profile_path, tmp_path, "slo")
    threshold = scaled(profile_path, tmp_path, "threshold")
    assert slo["completed"] == slo["requests"]  # drained nodes finished their requests
    # the threshold policy reacts once queues and TTFT have grown: it misses the SLO
    assert slo["slo_attainment"] >= 0.99 > threshold["slo_attainment"]
    assert len(slo["changes"]) <= 6, slo["changes"]  # a few moves, no oscillation
    assert [c[1] for c in slo["changes"]] == ["prefill"] * len(slo["changes"])
    assert (tmp_path / "slo.png").stat().st_size > 0
    # The peak needs 3 prefill nodes for 4 req/s of 0.5 s prompts: a fixed 3P+1D meets
    # the SLO over the same 1,500 s, at 6,000 node-seconds, and 2P+1D does not.
    fixed = {}
    for p in (2, 3):
        run = simulate(
            profile_path, tmp_path / f"fixed{p}.json", "--prefill", str(p), "--decode", "1",
            "--autoscale", "threshold", "--rate-curve", CURVE, "--curve-duration", "1500",
            "--prefill-min", str(p), "--prefill-max", str(p), "--decode-max", "1",
            "--seed", "1",
        )  # fmt: skip
        assert run["changes"] == []  # bounds fixed: the policy cannot move
        fixed[p] = run
    assert fixed[2]["slo_attainment"] < 0.99 <= fixed[3]["slo_attainment"]
    assert slo["node_seconds"] < fixed[3]["node_seconds"] * 0.8


def test_autoscale_options_are_checked(profile_path: str, tmp_path: Path) -> None:
    base = ["plan", "simulate", "--profile", profile_path, "--output", str(tmp_path / "x")]
    for extra, why in (
        (["--autoscale", "slo", "--colocated", "1"], "--prefill and --decode"),
        (["--autoscale", "slo", "--prefill", "1", "--decode", "1"], "--rate-curve"),
        (["--autoscale", "slo", "--prefill", "1", "--decode", "1", "--rate-curve", "9:1,1:1"],
         "ascending"),
    ):  # fmt: skip
        args = build_parser().parse_args([*base, *extra])
        assert why in (autoscale_sim.autoscale_problem(args) or ""), extra


def test_the_policy_sizes_the_nodes_the_run_simulates(profile_path: str) -> None:
    """The SLO policy's own simulations take every deployment option of the run (a GPU-like
    engine shape, the conditional choice), not the simulator's defaults, and no count."""
    argv = ["plan", "simulate", "--profile", profile_path, "--prefill", "2", "--decode", "3",
            "--max-num-seqs", "256", "--kv-cache-mb", "40000", "--prefill-max-batch", "16",
            "--conditional", "--autoscale", "slo", "--rate-curve", "0:1"]  # fmt: skip
    got = autoscale_sim._node_options(build_parser().parse_args(argv))
    assert got == ["--kv-cache-mb", "40000", "--max-num-seqs", "256",
                   "--prefill-max-batch", "16", "--conditional"]  # fmt: skip


def test_the_policy_sees_the_ttft_of_the_first_tokens_since_its_last_tick(
    profile_path: str,
) -> None:
    """As the controller reads the router's histogram each tick. The driver once took them
    from a list it updated only after, and fed the threshold policy no TTFT at all."""
    from tandem.autoscale.types import Decision, Observation
    from tandem.bench.metrics import Slo
    from tandem.plan.simulate import Deployment
    from tandem.plan.simulator import Simulation
    from tandem.plan.topology import Arrival

    argv = ["plan", "simulate", "--profile", profile_path, "--prefill", "1", "--decode", "1"]
    deployment = Deployment.of(build_parser().parse_args(argv))
    sim = Simulation(deployment.topology, deployment.decode_costs, deployment.prefill_costs)
    seen: list[Observation] = []

    class Watch:
        def observe(self, obs: Observation, current: dict[str, int]) -> list[Decision]:
            seen.append(obs)
            return []

    driver = autoscale_sim.ScaledRun(sim, Watch(), 1.0, 0.0, Slo(4.0, 0.2))
    driver.start()
    # 2 req/s for 20 s of 500-token prompts (0.5 s each on the one prefill node)
    sim.run([Arrival(k * 0.5, 500, 32) for k in range(40)], None, 300.0)
    ttfts = [o.ttft_p90 for o in seen if o.ttft_p90 is not None]
    assert len(ttfts) >= 15, ttfts  # first tokens in nearly every tick while it runs
    assert all(t >= 0.5 for t in ttfts)  # each waited for its prefill at least
    assert seen[-1].router is not None and seen[-1].router.arrivals == 40
