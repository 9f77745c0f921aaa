"""`tandem bench compare`: one workload against several stacks on the same cores, side by side.

- colocated: one decode node doing both phases in one engine, torch threads on every core
  (`tandem up --colocated`), with chunked prefill (its default): a long prompt is
  prefilled a chunk per step beside the running decodes, as vLLM's engine does. With
  `--colocated-url` this side is an outside server instead (e.g. vLLM itself).
- colocated-unchunked: the same with chunked prefill off: a long prompt's prefill runs
  whole between two decode steps, so every running stream stalls for it — the
  interference disaggregation removes.
- disaggregated: one prefill and one decode node, each pinned to a core of its own with
  one thread (`tandem up --pin-cores`): the same hardware in total, split by phase.
- conditional: the same two nodes, the router choosing per request where to prefill
  (`tandem up --conditional`, costs from `--profile` when given; with a profile the router
  is also given the run's TPOT target, `--slo-tpot`, as its `--tpot-target`: an operator
  serving to an SLO would configure it so).

All run through the same router and API, without a kvcache node (random prompts share no
prefix to reuse; its uploads would only spend the cores being compared), with the router's
first-token and stall timeouts raised to the client's and its liveness probe off, so a slow
request is measured as slow rather than cut off by failover (colocated mode has no
failover path: there is no prefill node to resume on). The sides run one after the other,
each on a fresh stack, with the same seed: the same requests at the same send times.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from shared.bus.server import free_port
from shared.errors import TandemError
from tandem.bench.loadgen import Target
from tandem.bench.serve import (
    check,
    slo_of,
    sweep_config,
    warn_duration,
    workload_of,
    write_outputs,
)
from tandem.bench.sweep import Sweep, run_sweep
from tandem.launcher import Stack
from tandem.plan.profile import cpu_name
from tandem.up_options import up_parser

SIDES = ("colocated", "colocated-unchunked", "disaggregated", "conditional")
ROUTES_METRIC = "tandem_router_routes_total"  # services/router/metrics.py


def side_options(side: str, args: argparse.Namespace) -> list[str]:
    """`tandem up` options of one side (all but the port)."""
    options = ["--kvcache", "0", "--decode", "1", *model_options(args)]
    if side == "colocated-unchunked":  # prompts prefilled whole between decode steps
        return [*options, "--colocated", "--step-token-budget", "0"]
    if side.startswith("colocated"):
        return [*options, "--colocated"]  # threads: every core of this process
    options += ["--prefill", "1", "--pin-cores"]  # a core and a thread each
    if side == "conditional":
        options += ["--conditional"]
        if args.profile:
            options += ["--profile", args.profile, "--tpot-target", f"{args.slo_tpot:g}"]
    return options


def model_options(args: argparse.Namespace) -> list[str]:
    """The model, dtype, data plane and KV pool every side's nodes run with."""
    return [
        *("--model", args.model, "--dtype", args.dtype, "--transport", args.transport),
        *("--kv-cache-mb", str(args.kv_cache_mb)),
    ]


def stack_env(args: argparse.Namespace) -> dict[str, str]:
    """Environment of every service of both sides (see the module docstring)."""
    timeout = f"{args.timeout:g}"
    return {
        "TANDEM_NO_KVCACHE": "1",
        "TANDEM_FIRST_TOKEN_TIMEOUT": timeout,
        "TANDEM_STALL_TIMEOUT": timeout,
        "TANDEM_PROBE_AFTER": "0",  # no liveness pings: nothing here fails, and they cost
        "TANDEM_CONDITIONAL": "0",  # only the conditional side's `--conditional` turns it on
        "TANDEM_TPOT_TARGET": "0",  # and its `--tpot-target` (side_options)
    }


def start_stack(
    options: list[str], args: argparse.Namespace, log: Path, env: dict[str, str] | None = None
) -> Stack:
    """`tandem up` with these options (and environment) on a free port, ready to serve."""
    stack = Stack(up_parser().parse_args(["up", "--port", str(free_port()), *options]))
    stack.env = {**stack_env(args), **(env or {})}
    stack.out = log.open("w")
    try:
        stack.start()
        stack.wait_ready()
    except BaseException:
        stack.stop()
        stack.out.close()
        raise
    return stack


def machine() -> dict[str, Any]:
    return {"cpus": sorted(os.sched_getaffinity(0)), "cpu_model": cpu_name()}


def measure(
    side: str,
    options: list[str],
    args: argparse.Namespace,
    log: Path,
    served: str,
    workload: Any,
    env: dict[str, str] | None = None,
) -> Sweep:
    """The sweep of `args` against a fresh `tandem up` stack with these options."""
    started = time.monotonic()
    print(f"[{side}] starting the stack (log: {log})", flush=True)
    stack = start_stack(options, args, log, env)
    try:
        print(f"[{side}] ready in {time.monotonic() - started:.0f}s at {stack.url}", flush=True)
        sweep = measure_url(side, stack.url, args, served, workload, routes=stack.url)
        for child in stack.dead_children():  # a crash during the run invalidates the side
            raise TandemError(f"{side}: {child.name} died during the run (see {log})")
        return sweep
    finally:
        stack.stop()
        stack.out.close()
        print(f"[{side}] done in {time.monotonic() - started:.0f}s", flush=True)


def measure_url(
    side: str,
    url: str,
    args: argparse.Namespace,
    served: str,
    workload: Any,
    routes: str | None = None,
) -> Sweep:
    """The sweep of `args` against a server already running at `url`; with `routes` (our
    router's URL), each point also counts the requests it routed local and remote."""
    target = Target(
        url=url,
        model=served,
        prompt_format=args.prompt_format,
        ignore_eos=not args.no_ignore_eos,
        api_key=args.api_key,
        timeout=args.timeout,
    )
    counts = None if routes is None else functools.partial(route_counts, routes)
    return asyncio.run(
        run_sweep(target, workload, sweep_config(args), slo_of(args), side, routes=counts)
    )


def route_counts(url: str) -> dict[str, int]:
    """Our router's requests so far by route (local, remote, resumed), from its /metrics;
    empty if they cannot be read (they explain a run, they decide nothing in it)."""
    counts: dict[str, int] = {}
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:  # noqa: S310 - ours
            families = list(text_string_to_metric_families(r.read().decode()))
    except (OSError, ValueError):
        return counts
    for family in families:
        for sample in family.samples:
            if sample.name == ROUTES_METRIC:
                route = str(sample.labels.get("route", ""))
                counts[route] = counts.get(route, 0) + int(sample.value)
    return counts


def measure_side(
    side: str, args: argparse.Namespace, log_dir: Path, served: str, workload: Any
) -> Sweep:
    if side == "colocated" and args.colocated_url:  # the best colocated engine at hand
        served = args.colocated_model or served
        print(f"[{side}] against {args.colocated_url} ({served})", flush=True)
        return measure_url(side, args.colocated_url, args, served, workload)
    log = log_dir / f"{Path(args.output).stem}-{side}.log"
    return measure(side, side_options(side, args), args, log, served, workload)


def run(args: argparse.Namespace) -> int:
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    problem = check(args)
    if problem is None and (not sides or any(s not in SIDES for s in sides)):
        problem = f"--sides takes a comma-separated list of {', '.join(SIDES)}"
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if len(os.sched_getaffinity(0)) < 2:
        print("warning: one CPU: the disaggregated nodes will share it", file=sys.stderr)
    warn_duration(args)
    out = Path(args.output)
    log_dir = Path(args.log_dir) if args.log_dir else out.parent
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        from shared.model.source import resolve_model

        served_name = resolve_model(args.model).served_name
        workload = workload_of(args)
        sweeps = [measure_side(side, args, log_dir, served_name, workload) for side in sides]
    except (TandemError, RuntimeError) as exc:  # RuntimeError: a stack that did not start
        print(f"error: {exc}", file=sys.stderr)
        return 1
    extra = {
        "machine": machine(),
        "sides": {s: side_options(s, args) for s in sides},  # `tandem up` options
        "colocated_url": args.colocated_url,
        "stack_env": stack_env(args),
    }
    write_outputs("tandem bench compare", args, sweeps, extra)
    return 0
