"""`tandem plan simulate`: what `tandem bench serve` would measure against a deployment,
computed from a profile instead of run (simulator.py).

It takes `tandem bench serve`'s workload, load and SLO options with the same names and
meanings, draws the same request lengths and send times for a seed, and writes the same
JSON document, table and plots, so a measured run and a simulated one compare line by
line. `--trace RUN.json` replays the requests of a `bench serve` output instead (their
lengths and send times). Warm-up requests are not simulated: a simulated node starts warm.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.costs.model import CostModel
from shared.costs.profile import Profile, read_profile
from shared.runtime.options import (
    PREFILL_MAX_BATCH,
    PREFILL_STEP_TOKENS,
    add_option,
    step_token_budget,
    target_seconds,
)
from tandem.bench.cli import Defaults, add_common_options
from tandem.bench.loadgen import arrival_times
from tandem.bench.metrics import RequestRecord, run_metrics
from tandem.bench.serve import check, slo_of, warn_duration, write_outputs
from tandem.bench.sweep import Point, Sweep, rate_label
from tandem.bench.workload import sample_lengths
from tandem.plan import compiled
from tandem.plan.simengine import EngineShape
from tandem.plan.simulator import DEFAULT_TIMEOUT, Simulation
from tandem.plan.topology import Arrival, Topology

DEFAULTS = Defaults("tandem-plan-simulate.json", 32, "inf", None, 2.0, 0.1)


def add_deployment_options(p: argparse.ArgumentParser) -> None:
    """The deployment and its nodes' engine options (the nodes' own names and defaults)."""
    add_option(p, "--profile", required=True, help="profile JSON (tandem plan profile|project)")
    add_option(
        p, "--prefill-profile", default=None, help="profile of the prefill nodes (default: same)"
    )
    # Not read from TANDEM_COLOCATED, which is the router's on/off switch of the same name.
    p.add_argument("--colocated", type=int, default=0, help="N decode nodes prefilling everything")
    add_option(p, "--prefill", type=int, default=0, help="prefill nodes")
    add_option(p, "--decode", type=int, default=0, help="decode nodes")
    add_option(
        p, "--kvcache", type=int, default=0, help="kvcache nodes (decode nodes then checkpoint)"
    )
    add_option(p, "--transport", default=None, help="the profile's transport (default: its first)")
    add_option(p, "--kv-cache-mb", type=int, default=1024, help="KV cache per node")
    add_option(p, "--max-num-seqs", type=int, default=64)
    add_option(p, "--max-batched-tokens", type=int, default=4096)
    add_option(
        p,
        "--step-token-budget",
        type=int,
        default=None,
        help="the decode nodes' (default: `tandem up`'s, colocated or split)",
    )
    add_option(p, "--prefill-chunk-tokens", type=int, default=512)
    add_option(
        p, "--no-prefill-bursts", action="store_true", help="the decode nodes' (tandem up's)"
    )
    add_option(
        p,
        "--prefill-max-batch",
        type=int,
        default=PREFILL_MAX_BATCH,
        help="jobs a prefill node fetches together at most (its --max-batch)",
    )
    add_option(
        p,
        "--prefill-step-tokens",
        type=int,
        default=PREFILL_STEP_TOKENS,
        help="prompt tokens one prefill step computes at most (the prefill nodes' --step-tokens)",
    )
    add_option(p, "--local-prefill-max-tokens", type=int, default=96)
    add_option(p, "--heartbeat", type=float, default=2.0, help="registry period, seconds")
    add_option(
        p,
        "--admission-latency",
        type=float,
        default=0.05,
        help="seconds from a request's send until a node has it (router, journal, NATS)",
    )
    add_option(
        p,
        "--conditional",
        action="store_true",
        help="per-request choice of prefill path (`tandem up --conditional`)",
    )
    add_option(
        p,
        "--tpot-target",
        type=target_seconds,
        default=0.0,
        help="the conditional choice's TPOT target, s (`tandem up --tpot-target`; 0: none)",
    )


def add_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    p = sub.add_parser("simulate", help="simulate a deployment under a workload, from a profile")
    add_deployment_options(p)
    add_common_options(p, DEFAULTS)
    add_option(p, "--trace", default=None, help="replay the requests of a bench serve JSON")
    p.set_defaults(func=run)
    return p


def engine_shape(args: argparse.Namespace, profile: Profile, prefill: bool) -> EngineShape:
    block = 16
    blocks = max(1, args.kv_cache_mb * (1 << 20) // (profile.kv_bytes_per_token * block))
    return EngineShape(
        num_blocks=blocks,
        block_size=block,
        max_num_seqs=args.max_num_seqs,
        # a prefill node's steps: the smaller of the two, as `tandem prefill` takes them
        max_num_batched_tokens=min(args.max_batched_tokens, args.prefill_step_tokens)
        if prefill
        else args.max_batched_tokens,
        step_token_budget=0 if prefill else decode_budget(args.step_token_budget, args.colocated),
        prefill_chunk_tokens=args.prefill_chunk_tokens,
        prefill_bursts=not args.no_prefill_bursts,
        # The simulated prompts share no prefix (as the bench's do not), so naming blocks
        # by hash would find nothing and cost a third of the simulation's time.
        enable_prefix_caching=False,
    )


def decode_budget(given: int | None, colocated: int) -> int:
    """The decode nodes' step budget, as `tandem up` would give them."""
    return step_token_budget(given, split=not colocated)


def topology_of(args: argparse.Namespace, decode: Profile, prefill: Profile) -> Topology:
    return Topology(
        colocated=args.colocated,
        prefill=args.prefill,
        decode=args.decode,
        decode_engine=engine_shape(args, decode, prefill=False),
        prefill_engine=engine_shape(args, prefill, prefill=True),
        prefill_max_batch=args.prefill_max_batch,
        local_max_tokens=args.local_prefill_max_tokens,
        heartbeat=args.heartbeat,
        conditional=args.conditional,
        tpot_target=args.tpot_target,
        admission_latency=args.admission_latency,
        kvcache=args.kvcache,
    )


def workload_points(args: argparse.Namespace) -> list[tuple[float | None, list[Arrival]]]:
    """Per swept rate, the requests `tandem bench serve` sends for these options."""
    points = []
    for i, rate in enumerate(args.request_rate):
        lengths = sample_lengths(
            args.prompt_len, args.output_len, args.num_requests, f"{args.seed}/point-{i}"
        )
        offsets = arrival_times(len(lengths), rate, args.arrival, random.Random(args.seed + i))
        arrivals = [
            Arrival(at, p, o)
            for (p, o), at in zip(lengths, offsets, strict=True)
            if args.duration is None or at < args.duration
        ]
        points.append((rate, arrivals))
    return points


def trace_points(path: str) -> list[tuple[float | None, list[Arrival]]]:
    """The requests of each point of a `tandem bench serve` JSON, at their send times."""
    try:
        doc = json.loads(Path(path).read_text())
        sweep = doc["sweeps"][0]
        return [
            (
                p["request_rate"],
                [Arrival(r["sent"], r["prompt_tokens"], r["max_tokens"]) for r in p["requests"]],
            )
            for p in sweep["points"]
        ]
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from exc
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"{path} is not a tandem bench serve JSON ({exc!r})") from exc


@dataclass(frozen=True)
class Deployment:
    """What every simulation of a command's options runs with: the topology and the costs
    of its decode and prefill nodes (the prefill profile, if given, for the prefill nodes
    and the transfers)."""

    topology: Topology
    decode_costs: CostModel
    prefill_costs: CostModel | None

    @classmethod
    def of(cls, args: argparse.Namespace) -> Deployment:
        decode = read_profile(args.profile)
        prefill = read_profile(args.prefill_profile) if args.prefill_profile else decode
        return cls(
            topology=topology_of(args, decode, prefill),
            decode_costs=CostModel(decode, args.transport),
            prefill_costs=CostModel(prefill, args.transport) if args.prefill_profile else None,
        )

    def run(
        self,
        arrivals: list[Arrival],
        concurrency: int | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        topology: Topology | None = None,
    ) -> list[RequestRecord]:
        """One fresh simulation (of `topology`, default this deployment's) on `arrivals`."""
        sim = Simulation(topology or self.topology, self.decode_costs, self.prefill_costs)
        return sim.run(arrivals, concurrency, timeout)


def simulate(args: argparse.Namespace) -> Sweep:
    deployment = Deployment.of(args)
    points = trace_points(args.trace) if args.trace else workload_points(args)
    sweep = Sweep(label(args), slo_of(args))
    if not args.quiet:
        print(f"[{sweep.label}] {compiled.describe()}", file=sys.stderr)
    for rate, arrivals in points:
        concurrency = None if args.trace else args.concurrency
        records = deployment.run(arrivals, concurrency, args.timeout)
        m = run_metrics(records, sweep.slo)
        sweep.points.append(Point(rate, args.concurrency, m, records))
        if not args.quiet:
            print(
                f"[{sweep.label}] rate {rate_label(rate)}: {m.completed}/{m.requests} ok, "
                f"{m.output_throughput:.1f} tok/s (simulated)",
                file=sys.stderr,
            )
    return sweep


def label(args: argparse.Namespace) -> str:
    if args.colocated:
        return f"simulated colocated x{args.colocated}"
    kind = "conditional " if args.conditional else ""
    return f"simulated {kind}{args.prefill}P:{args.decode}D"


def deployment_problem(args: argparse.Namespace, nodes_given: bool = True) -> str | None:
    """What is wrong with the deployment options (`nodes_given`: the node counts too)."""
    if args.kv_cache_mb < 1 or args.max_num_seqs < 1 or args.prefill_max_batch < 1:
        return "--kv-cache-mb, --max-num-seqs and --prefill-max-batch must be at least 1"
    if (args.step_token_budget or 0) < 0 or args.heartbeat <= 0 or args.admission_latency < 0:
        return (
            "--step-token-budget and --admission-latency cannot be negative, "
            "--heartbeat must be positive"
        )
    if min(args.prefill_chunk_tokens, args.max_batched_tokens, args.prefill_step_tokens) < 1:
        return (
            "--prefill-chunk-tokens, --max-batched-tokens and --prefill-step-tokens must be "
            "at least 1"
        )
    if not nodes_given:
        return None
    probe = Topology(colocated=args.colocated, prefill=args.prefill, decode=args.decode,
                     conditional=args.conditional)  # fmt: skip
    return probe.check()


def run(args: argparse.Namespace) -> int:
    problem = check(args) or deployment_problem(args)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if not args.trace:  # (a replayed run's requests are what they were)
        warn_duration(args)
    try:
        sweep = simulate(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    extra: dict[str, Any] = {"simulated": True, "profile": args.profile}
    write_outputs("tandem plan simulate", args, [sweep], extra)
    return 0
