"""`tandem up --autoscale --policy slo` on this machine under a rate ramp and a drop, beside
what `tandem plan simulate --autoscale slo` predicts for the very same arrivals (issue 53).

Two cores cannot show compute capacity growing with nodes, so capacity binds on memory: the
decode nodes get a small KV cache (`--kv-cache-mb`, default 24 MB: two of the workload's
sequences), and a second decode node doubles what can decode at once while the steps stay
small enough for three nodes to share two cores (at 48 MB and 3 req/s the real nodes fell
far behind the profile's pace). The stack:
`tandem up --split --prefill 1 --decode 1 --autoscale --policy slo` with the SLO, bounds
1-1 prefill and 1-`--decode-max` decode, the profile given (default: this machine's startup
profile, the one `tandem up` sizes with anyway).

The arrivals: a Poisson process following `--rate-curve` (tandem/plan/autoscale_sim.py's
`arrivals`, seeded), each request `--prompt-len` random word tokens and `--output-len`
tokens (ignore_eos), sent open loop at their times. The replica changes are read from the
stack's log as they appear (stamped with this script's clock, from the first send); the
simulator then replays the same arrivals with the same policy, profile, options and bounds,
its nodes serving `--node-start` seconds after a scale-up (default: the start measured here,
from the decision to the new node's "ready" line).

Printed: each side's replica changes (time, role, step), SLO attainment, node-seconds (a
node counts from its scale-up decision, the first ones from the first send, until its
scale-down decision; the simulator's own count also holds a draining node until it is
done), failed requests, and the host's CPU flags.

    python benchmarks/autoscale_ramp.py [--rate-curve 0:0.3,60:0.3,100:1.5,250:1.5,290:0.3,480:0.3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.vllm_compare import MODEL, start_tandem, stop, wait_ready  # noqa: E402
from shared.bus.server import free_port  # noqa: E402
from tandem.bench.loadgen import Load, Target, run_load  # noqa: E402
from tandem.bench.metrics import RequestRecord, Slo, run_metrics  # noqa: E402
from tandem.bench.workload import (  # noqa: E402
    RequestSpec,
    load_bench_tokenizer,
    parse_lengths,
    word_vocabulary,
)
from tandem.plan.autoscale_sim import RateCurve, arrivals  # noqa: E402
from tandem.plan.profile import cpu_flags, cpu_name  # noqa: E402

DECISION = re.compile(r"autoscale (prefill|decode)\S* ([+-]\d+):")
READY = re.compile(r"decode node (decode-\d+) ready")
READY_TIMEOUT = 600.0


class LogWatch(threading.Thread):
    """Reads the stack's log as it grows; each scale decision with the time it appeared."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.path = path
        self.zero = time.monotonic()
        self.decisions: list[tuple[float, str, int]] = []
        self.ready: dict[str, float] = {}  # decode node -> when its "ready" line appeared
        self.done = threading.Event()

    def run(self) -> None:
        with self.path.open(errors="replace") as log:
            part = ""
            while not self.done.is_set():
                part += log.readline()
                if not part.endswith("\n"):  # at the end, or half-written: wait for more
                    time.sleep(0.2)
                    continue
                line, part = part, ""
                at = time.monotonic() - self.zero
                if m := DECISION.search(line):
                    self.decisions.append((at, m.group(1), int(m.group(2))))
                elif m := READY.search(line):
                    self.ready[m.group(1)] = at


def node_seconds(start: dict[str, int], moves: list[tuple[float, str, int]], end: float) -> float:
    """Nodes x seconds from 0 to `end`, counts changing at each move's time."""
    total, count, last = 0.0, sum(start.values()), 0.0
    for at, _, delta in sorted(moves):
        at = min(max(at, 0.0), end)
        total += count * (at - last)
        count, last = count + delta, at
    return total + count * (end - last)


def common_flags(args: argparse.Namespace) -> list[str]:
    """What `tandem up` and `tandem plan simulate` take alike: the start, the nodes' KV,
    the SLO and the bounds (both name them the same)."""
    return [
        "--prefill", "1", "--decode", "1", "--kv-cache-mb", str(args.kv_cache_mb),
        "--slo-ttft", f"{args.slo_ttft:g}", "--slo-tpot", f"{args.slo_tpot:g}",
        "--slo-attainment", f"{args.slo_attainment:g}", "--prefill-min", "1",
        "--prefill-max", "1", "--decode-min", "1", "--decode-max", str(args.decode_max),
    ]  # fmt: skip


def up_flags(args: argparse.Namespace) -> list[str]:
    """`tandem up`'s flags for the run (its port, NATS port and dtype aside)."""
    return [
        "--split", *common_flags(args), "--autoscale", "--policy", "slo",
        *(["--scale-profile", args.profile] if args.profile else []),
    ]  # fmt: skip


def sizing_profile(args: argparse.Namespace) -> str:
    """The profile `tandem up` will size with for these flags (measured now if missing)."""
    from tandem.cli import build_parser
    from tandem.mode import prepare_slo_scaling

    up = build_parser().parse_args(["up", *up_flags(args)])
    prepare_slo_scaling(up)
    return str(up.scale_profile)


def real_run(args: argparse.Namespace, work: list[Any]) -> dict[str, Any]:
    tokenizer = load_bench_tokenizer(MODEL)
    ids, _ = word_vocabulary(tokenizer)
    rng = random.Random(args.seed)
    specs = [
        RequestSpec([rng.choice(ids) for _ in range(a.prompt_tokens)], "", a.max_tokens)
        for a in work
    ]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    logfile = args.workdir / "stack.log"
    proc = start_tandem(port, "float32", logfile, " ".join(up_flags(args)))
    watch = LogWatch(logfile)
    try:
        wait_ready(url + "/readyz", proc, READY_TIMEOUT)
        watch.start()

        async def load() -> list[RequestRecord]:
            watch.zero = time.monotonic()
            return await run_load(Target(url, MODEL, timeout=300), specs, Load(rate=None),
                                  offsets=[a.at for a in work])  # fmt: skip

        records = asyncio.run(load())
        end = time.monotonic() - watch.zero
        time.sleep(1.0)  # the last lines of the log
    finally:
        watch.done.set()
        stop(proc)
    slo = Slo(args.slo_ttft, args.slo_tpot)
    m = run_metrics(records, slo)
    ups = [at for at, role, d in watch.decisions if role == "decode" and d > 0]
    delays = [
        watch.ready[node] - at
        for k, at in enumerate(ups)
        if (node := f"decode-{k + 2}") in watch.ready
    ]
    errors: dict[str, int] = {}
    for r in records:
        if r.error is not None:
            errors[r.error[:80]] = errors.get(r.error[:80], 0) + 1
    return {
        "changes": watch.decisions,
        "slo_attainment": m.slo_attainment,
        "node_seconds": node_seconds({"prefill": 1, "decode": 1}, watch.decisions, end),
        "failed": sum(errors.values()),
        "errors": errors,
        "requests": len(records),
        "node_start": delays,
        "ttft_p50": m.ttft.p50,
        "tpot_p50": m.tpot.p50,
    }


def simulated(args: argparse.Namespace, node_start: float) -> dict[str, Any]:
    out = args.workdir / "simulated.json"
    cmd = [sys.executable, "-m", "tandem.cli", "plan", "simulate", "--profile", args.profile,
           *common_flags(args), "--prompt-len", args.prompt_len, "--output-len", args.output_len,
           "--rate-curve", args.rate_curve, "--curve-duration", f"{args.duration:g}",
           "--seed", str(args.seed), "--node-start", f"{node_start:g}", "--autoscale", "slo",
           "--output", str(out), "--plot", str(args.workdir / "simulated.png")]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, check=True)
    result: dict[str, Any] = json.loads(out.read_text())
    moves = [(t, role, delta) for t, role, delta, _ in result["changes"]]
    result["changes"] = moves
    result["decision_node_seconds"] = node_seconds(
        {"prefill": 1, "decode": 1}, moves, args.duration
    )
    return result


def changes(moves: list[tuple[float, str, int]]) -> str:
    return ", ".join(f"{role} {delta:+d} at {at:.0f} s" for at, role, delta in moves) or "none"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate-curve", default="0:0.3,60:0.3,100:1.5,250:1.5,290:0.3,480:0.3")
    ap.add_argument("--duration", type=float, default=480.0, help="seconds of arrivals")
    ap.add_argument("--prompt-len", default="200")
    ap.add_argument("--output-len", default="64")
    ap.add_argument("--kv-cache-mb", type=int, default=24, help="each decode node's KV cache")
    ap.add_argument("--decode-max", type=int, default=2)
    ap.add_argument("--slo-ttft", type=float, default=5.0)
    ap.add_argument("--slo-tpot", type=float, default=0.25)
    ap.add_argument("--slo-attainment", type=float, default=0.95)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--node-start", type=float, default=None,
                    help="the simulator's node start, s (default: measured here)")  # fmt: skip
    ap.add_argument("--profile", default=None, help="default: this machine's startup profile")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/tandem-autoscale-ramp"))
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    args.profile = args.profile or sizing_profile(args)
    curve = RateCurve.parse(args.rate_curve, args.duration)
    lengths = (parse_lengths(args.prompt_len), parse_lengths(args.output_len))
    work = arrivals(curve, args.duration, lengths, None, args.seed)
    print(f"{len(work)} requests over {args.duration:g} s, rate curve {args.rate_curve}",
          flush=True)  # fmt: skip
    real = real_run(args, work)
    print(f"real: {json.dumps(real)}", flush=True)
    start = args.node_start
    if start is None:
        start = sum(real["node_start"]) / len(real["node_start"]) if real["node_start"] else 20.0
    sim = simulated(args, start)
    print(f"\nCPU: {cpu_name()}; flags: {' '.join(cpu_flags())}; SmolLM2-135M float32")
    print(f"decode node start (decision to its \"ready\" line): "
          f"{', '.join(f'{s:.1f}' for s in real['node_start']) or '-'} s; "
          f"simulated with {start:.1f} s\n")  # fmt: skip
    print("| side | replica changes | SLO met | node-seconds | failed |")
    print("|---|---|---:|---:|---:|")
    print(f"| `tandem up --autoscale --policy slo` | {changes(real['changes'])} "
          f"| {real['slo_attainment']:.1%} | {real['node_seconds']:.0f} "
          f"| {real['failed']} of {real['requests']} |")  # fmt: skip
    print(f"| `tandem plan simulate --autoscale slo` | {changes(sim['changes'])} "
          f"| {sim['slo_attainment']:.1%} | {sim['decision_node_seconds']:.0f} "
          f"({sim['node_seconds']:.0f} to the drains' end) "
          f"| {sim['requests'] - sim['completed']} of {sim['requests']} |")  # fmt: skip
    (args.workdir / "summary.json").write_text(json.dumps({"real": real, "sim": sim}, indent=1))


if __name__ == "__main__":
    main()
