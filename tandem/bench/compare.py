"""`tandem bench compare`: one workload, two stacks on the same cores, side by side.

- colocated: one decode node doing both phases in one engine, torch threads on every core
  (`tandem up --colocated`); a long prompt's prefill runs between its decode steps, so
  every running stream stalls for it — the interference disaggregation removes.
- disaggregated: one prefill and one decode node, each pinned to a core of its own with
  one thread (`tandem up --pin-cores`): the same hardware in total, split by phase.

Both run through the same router and API, without a kvcache node (random prompts share no
prefix to reuse; its uploads would only spend the cores being compared), with the router's
first-token and stall timeouts raised to the client's and its liveness probe off, so a slow
request is measured as slow rather than cut off by failover (colocated mode has no
failover path: there is no prefill node to resume on). The sides run one after the other,
each on a fresh stack, with the same seed: the same requests at the same send times.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

from shared.bus.server import free_port
from shared.errors import TandemError
from tandem import up
from tandem.bench.loadgen import Target
from tandem.bench.serve import check, slo_of, sweep_config, workload_of, write_outputs
from tandem.bench.sweep import Sweep, run_sweep
from tandem.launcher import Stack

SIDES = ("colocated", "disaggregated")


def up_argv(side: str, args: argparse.Namespace, port: int) -> list[str]:
    """`tandem up` options of one side."""
    argv = ["up", "--port", str(port), "--kvcache", "0", "--decode", "1"]
    argv += ["--model", args.model, "--dtype", args.dtype, "--transport", args.transport]
    argv += ["--kv-cache-mb", str(args.kv_cache_mb)]
    if side == "colocated":
        return [*argv, "--colocated"]  # threads: every core of this process
    return [*argv, "--prefill", "1", "--pin-cores"]  # a core and a thread each


def stack_env(args: argparse.Namespace) -> dict[str, str]:
    """Environment of every service of both sides (see the module docstring)."""
    timeout = f"{args.timeout:g}"
    return {
        "TANDEM_NO_KVCACHE": "1",
        "TANDEM_FIRST_TOKEN_TIMEOUT": timeout,
        "TANDEM_STALL_TIMEOUT": timeout,
        "TANDEM_PROBE_AFTER": "0",  # no liveness pings: nothing here fails, and they cost
    }


def start_stack(side: str, args: argparse.Namespace, log: Path) -> Stack:
    parser = argparse.ArgumentParser(prog="tandem")
    up.add_parser(parser.add_subparsers(dest="command"))
    stack = Stack(parser.parse_args(up_argv(side, args, free_port())))
    stack.env = stack_env(args)
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
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), ""
            )
    except OSError:
        pass
    return {"cpus": sorted(os.sched_getaffinity(0)), "cpu_model": model}


def measure(side: str, args: argparse.Namespace, log: Path, served: str, workload: Any) -> Sweep:
    started = time.monotonic()
    print(f"[{side}] starting the stack (log: {log})", flush=True)
    stack = start_stack(side, args, log)
    try:
        print(f"[{side}] ready in {time.monotonic() - started:.0f}s at {stack.url}", flush=True)
        target = Target(
            url=stack.url,
            model=served,
            prompt_format=args.prompt_format,
            ignore_eos=not args.no_ignore_eos,
            timeout=args.timeout,
        )
        sweep = asyncio.run(run_sweep(target, workload, sweep_config(args), slo_of(args), side))
        for child in stack.dead_children():  # a crash during the run invalidates the side
            raise TandemError(f"{side}: {child.name} died during the run (see {log})")
        return sweep
    finally:
        stack.stop()
        stack.out.close()
        print(f"[{side}] done in {time.monotonic() - started:.0f}s", flush=True)


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
    out = Path(args.output)
    log_dir = Path(args.log_dir) if args.log_dir else out.parent
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        from shared.model.source import resolve_model

        served_name = resolve_model(args.model).served_name
        workload = workload_of(args)
        sweeps = [
            measure(side, args, log_dir / f"{out.stem}-{side}.log", served_name, workload)
            for side in sides
        ]
    except (TandemError, RuntimeError) as exc:  # RuntimeError: a stack that did not start
        print(f"error: {exc}", file=sys.stderr)
        return 1
    extra = {
        "machine": machine(),
        "sides": {s: up_argv(s, args, 0)[3:] for s in sides},  # `tandem up` options
        "stack_env": stack_env(args),
    }
    write_outputs("tandem bench compare", args, sweeps, extra)
    return 0
