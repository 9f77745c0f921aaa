"""`tandem bench serve`: load-test one OpenAI-compatible endpoint, ours or another server's."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import sys
from pathlib import Path
from typing import Any

from shared.errors import TandemError
from tandem import __version__
from tandem.bench import report
from tandem.bench.loadgen import Target
from tandem.bench.metrics import Slo
from tandem.bench.sweep import Sweep, SweepConfig, run_sweep
from tandem.bench.workload import Workload, load_bench_tokenizer, word_vocabulary


def workload_of(args: argparse.Namespace, tokenizer: Any = None) -> Workload:
    if tokenizer is None:
        tokenizer = load_bench_tokenizer(args.tokenizer or args.model)
    ids, texts = word_vocabulary(tokenizer)
    return Workload(args.prompt_len, args.output_len, ids, texts)


def sweep_config(args: argparse.Namespace) -> SweepConfig:
    return SweepConfig(
        rates=args.request_rate,
        num_requests=args.num_requests,
        arrival=args.arrival,
        concurrency=args.concurrency,
        duration=args.duration,
        warmup=args.warmup,
        seed=args.seed,
        quiet=args.quiet,
    )


def slo_of(args: argparse.Namespace) -> Slo:
    return Slo(ttft=args.slo_ttft, tpot=args.slo_tpot, attainment=args.slo_attainment)


def check(args: argparse.Namespace) -> str | None:
    """What is wrong with the options, if anything."""
    if args.num_requests < 1:
        return "--num-requests must be at least 1"
    if args.concurrency is not None and args.concurrency < 1:
        return "--concurrency must be at least 1"
    if not 0 < args.slo_attainment <= 1:
        return "--slo-attainment must be in (0, 1]"
    if args.timeout <= 0 or (args.duration is not None and args.duration <= 0):
        return "--timeout and --duration must be positive"
    return None


def duration_warnings(args: argparse.Namespace) -> list[str]:
    """Rates at which `--duration` stops sending before `--num-requests` are sent (the
    point then measures fewer requests than asked; what a user means to know)."""
    if args.duration is None:
        return []
    out = []
    for rate in args.request_rate:
        if rate is None or rate * args.duration >= args.num_requests:
            continue
        out.append(
            f"at {rate:g} req/s, --duration {args.duration:g} s sends about "
            f"{rate * args.duration:.0f} of the {args.num_requests} requests asked; "
            f"--duration {args.num_requests / rate:.0f} sends them all"
        )
    return out


def warn_duration(args: argparse.Namespace) -> None:
    for line in duration_warnings(args):
        print(f"warning: {line}", file=sys.stderr)


def document(
    tool: str, args: argparse.Namespace, sweeps: list[Sweep], extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    config = {
        k: v if isinstance(v, (int, float, str, bool, type(None), list)) else str(v)
        for k, v in vars(args).items()
        if k not in ("func", "api_key")  # a key does not belong in a results file
    }
    return {
        "tool": tool,
        "version": __version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "config": config,
        **(extra or {}),
        "sweeps": [report.sweep_json(s) for s in sweeps],
    }


def write_outputs(
    tool: str, args: argparse.Namespace, sweeps: list[Sweep], extra: dict[str, Any] | None = None
) -> None:
    out = Path(args.output)
    report.write_json(out, document(tool, args, sweeps, extra))
    print(report.table(sweeps))
    print(f"\nwrote {out}")
    try:
        paths = report.plot(sweeps, out)
    except ImportError:
        print(
            "matplotlib is not installed (pip install 'tandem[bench]'): no plots", file=sys.stderr
        )
        return
    for path in paths:
        print(f"wrote {path}")


async def _serve(args: argparse.Namespace) -> None:
    target = Target(
        url=args.url,
        model=args.model,
        prompt_format=args.prompt_format,
        ignore_eos=not args.no_ignore_eos,
        api_key=args.api_key,
        timeout=args.timeout,
    )
    sweep = await run_sweep(target, workload_of(args), sweep_config(args), slo_of(args), args.url)
    write_outputs("tandem bench serve", args, [sweep])


def run(args: argparse.Namespace) -> int:
    if (problem := check(args)) is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    warn_duration(args)
    try:
        asyncio.run(_serve(args))
    except TandemError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
