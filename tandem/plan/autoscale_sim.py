"""`tandem plan simulate --autoscale slo|threshold`: the autoscaler's own policy run on a
simulated cluster under a workload whose rate and mix change over time.

The workload: `--rate-curve T:R,T:R,...` (requests a second at each time, linear between,
for `--curve-duration` seconds; `diurnal:PEAK:LOW:PERIOD` is a day's sine), arrivals a
Poisson process of that rate (by thinning); each request's lengths are drawn from
`--prompt-len`/`--output-len`, or, with `--shift-prompt-len`/`--shift-output-len`, from
those with a probability growing linearly from 0 at the start to 1 at the end (a mix that
shifts).

The cluster starts at the deployment given (`--prefill`/`--decode`). Every
`--scale-interval` seconds of simulated time the driver builds the `Observation` the real
controller would (tandem/autoscale/controller.py: each node's registry entry, the prefill
queue, the router's TTFT p90 over the interval and its request and token counts) and asks
the policy the real autoscaler runs (`--autoscale threshold`: policy.py; `slo`: slo.py,
sizing with `--profile`); decisions start nodes that serve after `--node-start` seconds,
or drain chosen ones (simscale.py). Reported: SLO attainment over every request,
node-seconds (a node counts from its start to its end), the replica changes, and the
replicas over time (`--plot` draws them with the rate).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.autoscale.types import NodeSample, Observation, RouterCounts
from tandem.bench.metrics import RequestRecord, Slo, meets, run_metrics
from tandem.bench.workload import LengthDist, parse_lengths
from tandem.plan.topology import Arrival

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class RateCurve:
    """Requests a second over time: points (seconds, rate), linear between, flat after."""

    points: tuple[tuple[float, float], ...]

    @classmethod
    def parse(cls, spec: str, duration: float) -> RateCurve:
        """`T:R,T:R,...` or `diurnal:PEAK:LOW:PERIOD` (a sine from LOW at 0 to PEAK at half
        the period, sampled each 1/48 of a period); ValueError saying what is wrong."""
        if spec.startswith("diurnal:"):
            try:
                peak, low, period = (float(x) for x in spec.split(":")[1:])
            except ValueError:
                raise ValueError(f"{spec!r}: diurnal:PEAK:LOW:PERIOD") from None
            if not 0 <= low <= peak or period <= 0:
                raise ValueError(f"{spec!r}: need 0 <= LOW <= PEAK and PERIOD > 0")
            steps = max(2, math.ceil(duration / (period / 48)))
            pts = []
            for k in range(steps + 1):
                t = duration * k / steps
                phase = (1 - math.cos(2 * math.pi * t / period)) / 2
                pts.append((t, low + (peak - low) * phase))
            return cls(tuple(pts))
        try:
            pts = [(float(t), float(r)) for t, r in (p.split(":") for p in spec.split(","))]
        except ValueError:
            raise ValueError(f"{spec!r}: T:RATE,T:RATE,... (seconds, requests a second)") from None
        if any(r < 0 or t < 0 for t, r in pts) or [t for t, _ in pts] != sorted(t for t, _ in pts):
            raise ValueError(f"{spec!r}: times ascending, rates and times not negative")
        return cls(tuple(pts))

    def rate(self, t: float) -> float:
        pts = self.points
        if t <= pts[0][0]:
            return pts[0][1]
        for (t0, r0), (t1, r1) in itertools.pairwise(pts):
            if t <= t1:
                return r0 + (r1 - r0) * (t - t0) / (t1 - t0) if t1 > t0 else r1
        return pts[-1][1]

    def peak(self) -> float:
        return max(r for _, r in self.points)


def arrivals(
    curve: RateCurve,
    duration: float,
    lengths: tuple[LengthDist, LengthDist],
    shifted: tuple[LengthDist, LengthDist] | None,
    seed: int,
) -> list[Arrival]:
    """Poisson arrivals of the curve's rate (thinning), each with its lengths."""
    rng = random.Random(seed)
    peak = curve.peak()
    out: list[Arrival] = []
    t = 0.0
    while peak > 0:
        t += rng.expovariate(peak)
        if t >= duration:
            break
        if rng.random() * peak > curve.rate(t):
            continue
        prompt, output = lengths
        if shifted is not None and rng.random() < t / duration:
            prompt, output = shifted
        out.append(Arrival(t, prompt.sample(rng), output.sample(rng)))
    return out


@dataclass
class ScaledRun:
    """The policy over a running simulation; what it did and cost."""

    sim: Any  # tandem.plan.simulator.Simulation (compiled or not)
    policy: Any  # Policy or SloPolicy: observe(obs, current) -> decisions
    interval: float
    node_start: float
    slo: Slo
    changes: list[tuple[float, str, int, str]] = field(default_factory=list)
    timeline: list[tuple[float, int, int]] = field(default_factory=list)  # (t, P, D) started
    node_seconds: float = 0.0
    _last: float = 0.0
    _counted: int = 0  # records whose prompt tokens are counted (send order)
    _open: list[RequestRecord] = field(default_factory=list)  # sent, no first token yet
    _streaming: list[RequestRecord] = field(default_factory=list)  # first token, not ended
    _counts: list[float] = field(default_factory=lambda: [0.0] * 5)
    _ttfts: list[float] = field(default_factory=list)  # of the first tokens since the last tick

    def start(self) -> None:
        self.timeline.append((0.0, *self._started()))
        self.sim.at(self.interval, self.tick)

    def _started(self) -> tuple[int, int]:
        """Nodes paid for per role: up (draining too) or starting."""
        sim = self.sim
        starting = list(sim.starting.values())
        return (
            len(sim.prefillers) + starting.count("prefill"),
            len(sim.decoders) + starting.count("decode"),
        )

    def _account(self) -> None:
        now = self.sim.now
        self.node_seconds += sum(self._started()) * (now - self._last)
        self._last = now

    def finish(self) -> None:
        self._account()

    def tick(self) -> None:
        sim = self.sim
        self._account()
        obs = self.observe()
        current = {
            role: sum(1 for n in sim.live(role) if n not in sim.draining)
            + list(sim.starting.values()).count(role)
            for role in ROLES
        }
        for d in self.policy.observe(obs, current):
            if d.delta > 0:
                for _ in range(d.delta):
                    sim.add_node(d.role, self.node_start)
            else:
                for node_id in d.remove:
                    sim.drain_node(node_id)
            self.changes.append((sim.now, d.role, d.delta, d.reason))
        self.timeline.append((sim.now, *self._started()))
        sim.at(sim.now + self.interval, self.tick)

    def observe(self) -> Observation:
        sim = self.sim
        nodes = []
        for node_id, node in sim.decoders.items():
            pool = node.engine.scheduler.pool
            nodes.append(NodeSample(node_id, "decode", node.engine.scheduler.num_running,
                                    pool.num_free, pool.num_blocks,
                                    node_id in sim.draining))  # fmt: skip
        for node_id, node in sim.prefillers.items():
            nodes.append(NodeSample(node_id, "prefill", node.batch,
                                    draining=node_id in sim.draining))  # fmt: skip
        counts = self._count()
        ttft = self._ttft_p90()  # of what `_count` just saw
        return Observation(sim.now, nodes, len(sim.queue), ttft, counts)

    def _count(self) -> RouterCounts:
        """The router's counts: requests given a first token, their prompt tokens (and
        squares), the output tokens (and squares) of the requests that ended, and the
        requests admitted (kept incrementally)."""
        records = self.sim.records
        self._open.extend(records[self._counted :])
        self._counted = len(records)
        counts = self._counts
        still: list[RequestRecord] = []
        self._ttfts = []
        for r in self._open:
            if r.chunks:
                counts[0] += 1
                counts[1] += r.prompt_tokens
                counts[3] += r.prompt_tokens * r.prompt_tokens
                self._streaming.append(r)
                self._ttfts.append(r.chunks[0] - r.sent)
            elif not _ended(r):
                still.append(r)
        self._open = still
        going: list[RequestRecord] = []
        for r in self._streaming:
            if _ended(r):
                counts[2] += r.output_tokens
                counts[4] += r.output_tokens * r.output_tokens
            else:
                going.append(r)
        self._streaming = going
        requests, prompt, output, prompt_sq, output_sq = counts
        return RouterCounts(requests, prompt, output, float(self._counted), prompt_sq, output_sq)

    def _ttft_p90(self) -> float | None:
        """Of the first tokens since the last tick, as the controller reads the router's
        histogram (`_count` gathers them: call it first). It once read them from the
        requests still streaming before `_count` had added the new ones, and so saw almost
        none: the threshold policy ran blind to TTFT in every simulation."""
        ttfts = sorted(self._ttfts)
        return ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))] if ttfts else None

    def summary(self, records: list[RequestRecord]) -> dict[str, Any]:
        m = run_metrics(records, self.slo)
        met: dict[int, list[int]] = {}  # minute sent -> [requests, meeting the SLO]
        for r in records:
            counts = met.setdefault(int(r.sent // 60), [0, 0])
            counts[0] += 1
            counts[1] += meets(r, self.slo)
        ups = sum(1 for c in self.changes if c[2] > 0)
        return {
            "requests": m.requests,
            "completed": m.completed,
            "slo_attainment": m.slo_attainment,
            "node_seconds": self.node_seconds,
            "changes": len(self.changes),
            "scale_ups": ups,
            "scale_downs": len(self.changes) - ups,
            "peak_nodes": max(p + d for _, p, d in self.timeline),
            # where a run misses: the share meeting the SLO of each minute's arrivals
            "attainment_by_minute": [
                (60.0 * minute, good / n) for minute, (n, good) in sorted(met.items())
            ],
        }


def _ended(r: RequestRecord) -> bool:
    """Finished or failed (the simulation sets `done` to the time either happened)."""
    return r.error is not None or r.done > 0


def add_options(p: argparse.ArgumentParser) -> None:
    """`tandem plan simulate`'s autoscaling options (the policies' own: options.py)."""
    from shared.runtime.options import add_option
    from tandem.autoscale.options import add_policy_options

    add_option(
        p,
        "--autoscale",
        choices=("slo", "threshold"),
        default=None,
        help="run the autoscaler's policy over the simulated cluster under --rate-curve",
    )
    add_option(
        p,
        "--rate-curve",
        default=None,
        help="--autoscale: T:RATE,T:RATE,... (linear between) or diurnal:PEAK:LOW:PERIOD",
    )
    add_option(p, "--curve-duration", type=float, default=3600.0, help="seconds of workload")
    add_option(
        p, "--shift-prompt-len", type=parse_lengths, default=None,
        help="the prompt lengths the mix shifts to by the end (same forms as --prompt-len)",
    )  # fmt: skip
    add_option(p, "--shift-output-len", type=parse_lengths, default=None)
    add_option(
        p, "--node-start", type=float, default=30.0,
        help="seconds from a node's start to its first heartbeat (loading its model)",
    )  # fmt: skip
    add_option(p, "--plot", default=None, help="--autoscale: a PNG of replicas and rate")
    add_policy_options(p, slo_targets=False)  # simulate's own --slo-* are the targets
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """`tandem plan simulate`: with --autoscale, this module's run; else simulate's."""
    from tandem.bench.serve import check
    from tandem.plan.simulate import deployment_problem
    from tandem.plan.simulate import run as run_fixed

    if args.autoscale is None:
        return run_fixed(args)
    problem = check(args) or deployment_problem(args) or autoscale_problem(args)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        result = run_autoscaled(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    Path(args.output).write_text(json.dumps(result, indent=1))
    return 0


def autoscale_problem(args: argparse.Namespace) -> str | None:
    if args.autoscale is None:
        return None
    if args.colocated:
        return "--autoscale scales prefill and decode nodes: give --prefill and --decode"
    if not args.rate_curve:
        return "--autoscale needs --rate-curve"
    if args.curve_duration <= 0 or args.node_start < 0 or args.scale_interval <= 0:
        return "--curve-duration and --scale-interval must be > 0, --node-start >= 0"
    try:
        RateCurve.parse(args.rate_curve, args.curve_duration)
    except ValueError as exc:
        return str(exc)
    return None


def run_autoscaled(args: argparse.Namespace) -> dict[str, Any]:
    """Simulate the curve under the policy; the summary, the changes and the timeline."""
    from tandem.autoscale.policies import policy_from_args
    from tandem.bench.serve import slo_of
    from tandem.plan.simulate import Deployment, label
    from tandem.plan.simulator import Simulation

    deployment = Deployment.of(args)
    curve = RateCurve.parse(args.rate_curve, args.curve_duration)
    shifted = None
    if args.shift_prompt_len is not None or args.shift_output_len is not None:
        shifted = (
            args.shift_prompt_len or args.prompt_len,
            args.shift_output_len or args.output_len,
        )
    work = arrivals(curve, args.curve_duration, (args.prompt_len, args.output_len), shifted,
                    args.seed)  # fmt: skip
    policy_args = argparse.Namespace(**{**vars(args), "policy": args.autoscale,
                                        "scale_profile": args.profile})  # fmt: skip
    policy = policy_from_args(policy_args, _node_options(args))
    sim = Simulation(deployment.topology, deployment.decode_costs, deployment.prefill_costs)
    driver = ScaledRun(sim, policy, args.scale_interval, args.node_start, slo_of(args))
    driver.start()
    records = sim.run(work, None, args.timeout)
    driver.finish()
    out = driver.summary(records)
    out.update(label=f"{label(args)}, autoscaled ({args.autoscale})", rate_curve=args.rate_curve)
    out["timeline"] = driver.timeline
    out["changes"] = [(t, role, delta, why) for t, role, delta, why in driver.changes]
    if args.plot:
        plot(args.plot, curve, driver.timeline, out["attainment_by_minute"], out["label"])
    if not args.quiet:
        print(
            f"[{out['label']}] {out['completed']}/{out['requests']} ok, SLO met "
            f"{out['slo_attainment']:.1%}, {out['node_seconds']:.0f} node-seconds, "
            f"{len(driver.changes)} replica changes",
            file=sys.stderr,
        )
    return out


def _node_options(args: argparse.Namespace) -> list[str]:
    """The deployment's options as given (every one but the node counts and the profile),
    for the SLO policy's own simulations: they must size the nodes this run simulates."""
    from tandem.plan.simulate import add_deployment_options

    parser = argparse.ArgumentParser(add_help=False)
    add_deployment_options(parser)
    out: list[str] = []
    for action in parser._actions:
        counts = action.dest in ("profile", "prefill", "decode", "colocated")
        if counts or not action.option_strings:
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default or value is None:
            continue
        flag = action.option_strings[0]
        out += [flag] if isinstance(value, bool) else [flag, str(value)]
    return out


def plot(
    path: str,
    curve: RateCurve,
    timeline: list[tuple[float, int, int]],
    attained: list[tuple[float, float]],
    title: str,
) -> None:
    """Rate and nodes over time above; below, the share of each minute's arrivals that
    met the SLO (where a policy falls behind shows there)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rate_ax, met_ax) = plt.subplots(
        2, 1, figsize=(9, 5.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    ts = [t for t, _, _ in timeline]
    rate_ax.plot(ts, [curve.rate(t) for t in ts], color="grey", label="rate (req/s)")
    rate_ax.set_ylabel("requests a second")
    nodes_ax = rate_ax.twinx()
    nodes_ax.step(ts, [p for _, p, _ in timeline], where="post", label="prefill nodes")
    nodes_ax.step(ts, [d for _, _, d in timeline], where="post", label="decode nodes")
    nodes_ax.set_ylabel("nodes")
    fig.legend(loc="upper left")
    rate_ax.set_title(title)
    met_ax.step([t for t, _ in attained], [100 * a for _, a in attained], where="post")
    met_ax.set_ylabel("SLO met (%)")
    met_ax.set_ylim(0, 105)
    met_ax.set_xlabel("simulated seconds (SLO met: of the requests sent in each minute)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
