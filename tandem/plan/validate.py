"""`tandem plan validate`: a real `tandem bench serve` run and the simulator on the same
requests, side by side, with the simulator's relative errors.

The measured side starts the deployment with `tandem up` (as `tandem bench compare` does:
no kvcache node unless asked, liveness probes off, timeouts at the client's), runs the
sweep, and stops it. The simulated side replays that run's requests at their send times
(`tandem plan simulate --trace`), so both sides saw the very same arrivals. The stack
runs with the options the simulation is given (engine, chunking, local prefill limit,
heartbeat, conditional routing, the prefill nodes' `--max-batch` and `--step-tokens`);
the prefill nodes run every batch on one thread count (`--prefill-idle-threads 0`: a lone
prompt on every core is not simulated). Errors are
(simulated − measured) / measured for TTFT p50 and p90, TPOT p50 and output tokens/s.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from shared.costs.profile import read_profile
from shared.errors import TandemError
from shared.runtime.options import add_option
from tandem.bench import compare
from tandem.bench.cli import COMPARE, add_common_options
from tandem.bench.metrics import run_metrics
from tandem.bench.serve import check, workload_of, write_outputs
from tandem.bench.sweep import Point, Sweep, rate_label
from tandem.plan import simulate
from tandem.plan.topology import Arrival

# what is compared: a metric of a point's `metrics` (as in the JSON), and a summary's field
COMPARED: dict[str, tuple[str, str | None]] = {
    "TTFT p50": ("ttft", "p50"),
    "TTFT p90": ("ttft", "p90"),
    "TPOT p50": ("tpot", "p50"),
    "out tok/s": ("output_throughput", None),
}


def figure(metrics: dict[str, Any], name: str) -> float | None:
    """One compared figure of a point's metrics, in their JSON form (`asdict(RunMetrics)`)."""
    key, field = COMPARED[name]
    value: float | None = metrics[key] if field is None else metrics[key][field]
    return value


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("validate", help="a measured run and its simulation, side by side")
    simulate.add_deployment_options(p)
    add_common_options(p, replace(COMPARE, output="tandem-plan-validate.json"))
    add_option(p, "--pin-cores", action="store_true", help="each model node on a core of its own")
    add_option(p, "--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    add_option(p, "--log-dir", default=None, help="the stack's log (default: beside --output)")
    p.set_defaults(func=run)


def up_options(args: argparse.Namespace) -> list[str]:
    """The `tandem up` options of the deployment being validated."""
    options = ["--kvcache", str(args.kvcache), *compare.model_options(args)]
    options += ["--heartbeat-ttl", f"{args.heartbeat * 3:g}"]  # nodes beat every ttl / 3
    if args.step_token_budget is not None:  # else tandem up's default, as simulated
        options += ["--step-token-budget", str(args.step_token_budget)]
    options += ["--prefill-chunk-tokens", str(args.prefill_chunk_tokens)]
    if args.no_prefill_bursts:
        options.append("--no-prefill-bursts")
    if args.colocated:
        options += ["--colocated", "--decode", str(args.colocated)]
    else:
        options += ["--prefill", str(args.prefill), "--decode", str(args.decode)]
    if args.conditional:
        options += ["--conditional", "--profile", args.profile]
    # A lone prompt on every core is not simulated (a profile times one thread count):
    # the measured prefill nodes keep theirs, as the simulated ones do.
    options += ["--prefill-idle-threads", "0"]
    return [*options, "--pin-cores"] if args.pin_cores else options


def engine_env(args: argparse.Namespace) -> dict[str, str]:
    """The node and router options the simulation was given that `tandem up` has no flag
    for, for the measured stack too (`tandem up` passes its children the environment; the
    chunking options go as flags, `up_options`)."""
    return {
        "TANDEM_MAX_NUM_SEQS": str(args.max_num_seqs),
        "TANDEM_MAX_BATCHED_TOKENS": str(args.max_batched_tokens),
        "TANDEM_LOCAL_PREFILL_MAX_TOKENS": str(args.local_prefill_max_tokens),
        "TANDEM_TPOT_TARGET": f"{args.tpot_target:g}",  # the router's
        "TANDEM_MAX_BATCH": str(args.prefill_max_batch),  # the prefill nodes'
        "TANDEM_STEP_TOKENS": str(args.prefill_step_tokens),  # theirs too
    }


def replay(args: argparse.Namespace, measured: Sweep) -> Sweep:
    """The simulator on the measured requests, at their send times."""
    deployment = simulate.Deployment.of(args)
    out = Sweep(simulate.label(args), measured.slo)
    for point in measured.points:
        arrivals = [Arrival(r.sent, r.prompt_tokens, r.max_tokens) for r in point.records]
        records = deployment.run(arrivals)
        out.points.append(
            Point(point.rate, point.concurrency, run_metrics(records, out.slo), records)
        )
    return out


@dataclass
class Error:
    rate: float | None
    metric: str
    measured: float | None
    simulated: float | None

    @property
    def relative(self) -> float | None:
        if self.measured is None or self.simulated is None or self.measured == 0:
            return None
        return (self.simulated - self.measured) / self.measured


def errors(measured: Sweep, simulated: Sweep) -> list[Error]:
    return point_errors(
        [(p.rate, asdict(p.metrics)) for p in measured.points],
        [asdict(p.metrics) for p in simulated.points],
    )


def point_errors(
    measured: list[tuple[float | None, dict[str, Any]]], simulated: list[dict[str, Any]]
) -> list[Error]:
    """Every compared figure of each (rate, metrics) point against its simulated twin."""
    return [
        Error(rate, name, figure(m, name), figure(s, name))
        for (rate, m), s in zip(measured, simulated, strict=True)
        for name in COMPARED
    ]


def table(rows: list[Error]) -> str:
    lines = ["| rate req/s | metric | measured | simulated | error |", "|---:|---|---:|---:|---:|"]
    for e in rows:
        rel = "-" if e.relative is None else f"{e.relative:+.0%}"
        lines.append(
            f"| {rate_label(e.rate)} | {e.metric} | {_v(e.measured)} | {_v(e.simulated)} | {rel} |"
        )
    known = [abs(r) for e in rows if (r := e.relative) is not None]
    if known:
        within = sum(1 for r in known if r <= 0.2)
        lines.append(
            f"\nmedian |error| {statistics.median(known):.0%}, max {max(known):.0%}; "
            f"{within}/{len(known)} within 20%"
        )
    return "\n".join(lines)


def _v(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def error_json(rows: list[Error]) -> list[dict[str, Any]]:
    return [
        {
            "request_rate": e.rate,
            "metric": e.metric,
            "measured": e.measured,
            "simulated": e.simulated,
            "relative_error": e.relative,
        }
        for e in rows
    ]


def run(args: argparse.Namespace) -> int:
    problem = check(args) or simulate.deployment_problem(args)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    args.transport = args.transport or "tcp"  # the stack's data plane and the profile's
    out = Path(args.output)
    log = Path(args.log_dir or out.parent) / f"{out.stem}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        read_profile(args.profile)  # a bad profile fails before the long run
        from shared.model.source import resolve_model

        served = resolve_model(args.model).served_name
        measured = compare.measure(
            "measured", up_options(args), args, log, served, workload_of(args), engine_env(args)
        )
        simulated = replay(args, measured)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (TandemError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    rows = errors(measured, simulated)
    extra = {"machine": compare.machine(), "up": up_options(args), "errors": error_json(rows)}
    write_outputs("tandem plan validate", args, [measured, simulated], extra)
    print()
    print(table(rows))
    return 0
