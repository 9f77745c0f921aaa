"""A decode pool shared by two models against a pool per model (issue 27), same number of
decode processes, on this host.

Two models with the same costs: SmolLM2-135M under its own name (A) and under a second
name (B). Two deployments, each colocated (decode processes prefill their own requests),
each with two decode processes of one thread and the same KV memory per process:
- dedicated: `tandem up --colocated --decode 1 --model A --model B`: a process per model;
- shared: `tandem up --colocated --decode 2 --shared-decode --model A --model B`: both
  processes host both models (one engine thread, one KV budget per process).
Two workloads, each `--phases` phases of `--phase-seconds`, Poisson arrivals:
- alternating: model A at `--rate` while B idles, then the reverse, and so on;
- steady: both models at `--rate` / 2 the whole time (the same requests per second).
Per model and in all: requests, how many met the SLO (TTFT and TPOT), good requests per
second, TTFT and TPOT percentiles; and the shared pool's goodput against the dedicated
one's. Each deployment runs alone; the same requests and send times for both.

    python benchmarks/shared_decode.py [--rate 2] [--phase-seconds 40] [--phases 4]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared.bus.server import free_port  # noqa: E402
from tandem.bench.client import request_body, send  # noqa: E402
from tandem.bench.loadgen import Target, session  # noqa: E402
from tandem.bench.metrics import RequestRecord, Slo, meets, run_metrics  # noqa: E402
from tandem.bench.workload import RequestSpec  # noqa: E402
from tandem.cli import build_parser  # noqa: E402
from tandem.launcher import Stack  # noqa: E402
from tandem.plan.profile import cpu_flags  # noqa: E402

A, B = "smollm2-135m-instruct", "smol-b"
MODELS = ["--model", A, "--model", f"{B}={A}"]
SIDES = {
    "dedicated": ["--decode", "1"],
    "shared": ["--decode", "2", "--shared-decode"],
}


@dataclass
class Phase:
    start: float  # seconds from the run's start
    rates: dict[str, float]  # model → requests/s during it


def phases(workload: str, rate: float, count: int, seconds: float) -> list[Phase]:
    if workload == "alternating":
        return [Phase(i * seconds, {(A, B)[i % 2]: rate}) for i in range(count)]
    return [Phase(i * seconds, {A: rate / 2, B: rate / 2}) for i in range(count)]


def requests(
    plan: list[Phase], seconds: float, prompt_len: int, output_len: int, seed: int
) -> dict[str, list[tuple[float, RequestSpec]]]:
    """Each model's requests and send offsets (the same for both deployments)."""
    rng = random.Random(seed)
    out: dict[str, list[tuple[float, RequestSpec]]] = {A: [], B: []}
    for phase in plan:
        for model, rate in phase.rates.items():
            t = phase.start + rng.expovariate(rate)
            while t < phase.start + seconds:
                ids = [rng.randrange(1000, 40000) for _ in range(prompt_len)]
                out[model].append((t, RequestSpec(ids, "", output_len)))
                t += rng.expovariate(rate)
    return out


async def drive(
    url: str, todo: dict[str, list[tuple[float, RequestSpec]]]
) -> dict[str, list[RequestRecord]]:
    """Send every model's requests at their offsets (one clock for all); their records."""
    start = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - start

    target = Target(url, A)
    async with session(target, sum(map(len, todo.values()))) as http:

        async def one(model: str, at: float, spec: RequestSpec) -> RequestRecord:
            if (delay := at - clock()) > 0:
                await asyncio.sleep(delay)
            rec = RequestRecord(prompt_tokens=len(spec.prompt_ids), max_tokens=spec.max_tokens)
            body = request_body(spec, model, "tokens", True)
            await send(http, target.completions_url, body, rec, target.timeout, clock)
            return rec

        tasks = {
            model: [asyncio.create_task(one(model, at, spec)) for at, spec in items]
            for model, items in todo.items()
        }
        got = {model: list(await asyncio.gather(*ts)) for model, ts in tasks.items()}
    return got


def run_side(
    side: str, args: argparse.Namespace, todo: dict[str, list[tuple[float, RequestSpec]]], log: Path
) -> dict[str, list[RequestRecord]]:
    argv = ["up", "--colocated", "--kvcache", "0", "--transport", "tcp", *MODELS]
    argv += [*SIDES[side], "--kv-cache-mb", str(args.kv_cache_mb), "--port", str(free_port())]
    stack = Stack(build_parser().parse_args(argv))
    stack.out = log.open("w")
    try:
        stack.start()
        stack.wait_ready(timeout=300)
        time.sleep(3)  # every process's nodes registered (readyz needs one per model)
        return asyncio.run(drive(stack.url, todo))
    finally:
        stack.stop()


def fmt(x: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=2.0, help="requests/s of the busy model")
    ap.add_argument("--phase-seconds", type=float, default=40.0)
    ap.add_argument("--phases", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--kv-cache-mb", type=int, default=256, help="KV memory per process")
    ap.add_argument("--slo-ttft", type=float, default=3.0)
    ap.add_argument("--slo-tpot", type=float, default=0.15)
    ap.add_argument("--workloads", default="alternating,steady")
    ap.add_argument("--sides", default="dedicated,shared")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--logs", default="/tmp/shared-decode-bench")
    args = ap.parse_args()
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    slo = Slo(ttft=args.slo_ttft, tpot=args.slo_tpot)
    print(f"CPU flags: {' '.join(cpu_flags())}")
    print(
        f"rate {args.rate:g} req/s, {args.phases} phases of {args.phase_seconds:g} s, prompts "
        f"{args.prompt_len}, outputs {args.output_len}, SLO TTFT {slo.ttft:g} s TPOT "
        f"{slo.tpot * 1e3:.0f} ms, {args.kv_cache_mb} MB KV per process\n"
    )
    print(
        "| workload | side | model | ok | met SLO | good req/s | TTFT p50 s | TTFT p90 s "
        "| TPOT p50 ms | TPOT p90 ms |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    duration = args.phases * args.phase_seconds
    ratios = []
    for workload in args.workloads.split(","):
        plan = phases(workload, args.rate, args.phases, args.phase_seconds)
        todo = requests(plan, args.phase_seconds, args.prompt_len, args.output_len, args.seed)
        good: dict[str, float] = {}
        for side in args.sides.split(","):
            began = time.monotonic()
            by_model = run_side(side, args, todo, logs / f"{workload}-{side}.log")
            every = [r for records in by_model.values() for r in records]
            for model, records in [*by_model.items(), ("both", every)]:
                m = run_metrics(records, slo)
                met = sum(1 for r in records if r.error is None and meets(r, slo))
                print(
                    f"| {workload} | {side} | {model} | {m.completed}/{m.requests} | {met} "
                    f"| {met / duration:.2f} | {fmt(m.ttft.p50)} | {fmt(m.ttft.p90)} "
                    f"| {fmt(m.tpot.p50, 1e3, 0)} | {fmt(m.tpot.p90, 1e3, 0)} |",
                    flush=True,
                )
                if model == "both":
                    good[side] = met / duration
            errors = Counter(r.error[:80] for r in every if r.error is not None)
            for error, n in errors.most_common(3):
                print(f"  ({side}: {n} failed: {error})", flush=True)
            print(f"  ({side}: {time.monotonic() - began:.0f} s)", file=sys.stderr, flush=True)
        if {"dedicated", "shared"} <= set(good) and good["dedicated"]:
            ratios.append((workload, good["shared"] / good["dedicated"]))
    for workload, ratio in ratios:
        print(f"\n{workload}: the shared pool's goodput is {ratio:.2f}x the dedicated pools'")


if __name__ == "__main__":
    main()
