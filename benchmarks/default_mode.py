"""`tandem up`'s default (the planner's pick) against each mode forced, side by side on one
host: the steady W16 workload (16 streams of 256-token prompts, 128 output tokens, closed
loop) and the mixed one (100- and 1,500-token prompts, one in five long, 32 output tokens, at
rising rates; goodput at TTFT 10 s and TPOT 250 ms, 90% of requests).

Every side is `tandem up` as a user runs it, with only its mode flag (none for the default),
started fresh, measured with `tandem bench serve`, then stopped. `--rounds 2` runs every
side twice, each round starting one side later (A B C, B C A), so a slow minute of a noisy
host does not land on one side only; the table keeps each round's figures. The default and
`--conditional` run the same stack where the planner picks conditional: the pair shows the
host's noise.

    python benchmarks/default_mode.py [--rounds 1] [--rates 1,1.5,2,2.5]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.vllm_compare import MODEL, start_tandem, stop, wait_ready  # noqa: E402
from shared.bus.server import free_port  # noqa: E402
from tandem.bench.metrics import goodput  # noqa: E402
from tandem.plan.profile import cpu_flags, cpu_name  # noqa: E402

SIDES = {"default": "", "split": "--split", "colocated": "--colocated",
         "conditional": "--conditional"}  # fmt: skip
READY_TIMEOUT = 600.0  # a first start measures the startup profile
STEADY = ["--prompt-len", "256", "--output-len", "128", "--concurrency", "16",
          "--num-requests", "48", "--warmup", "2"]  # fmt: skip
MIXED = ["--prompt-len", "mix:100:1500:0.2", "--output-len", "32", "--num-requests", "30",
         "--slo-ttft", "10", "--slo-tpot", "0.25", "--slo-attainment", "0.9",
         "--warmup", "2"]  # fmt: skip


def bench(url: str, options: list[str], seed: int, out: Path) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "tandem.cli", "bench", "serve", "--url", url, "--model", MODEL,
           *options, "--timeout", "600", "--quiet", "--seed", str(seed),
           "--output", str(out)]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    points: list[dict[str, Any]] = json.loads(out.read_text())["sweeps"][0]["points"]
    return points


def measure(side: str, url: str, rnd: int, args: argparse.Namespace) -> dict[str, Any]:
    steady = bench(url, STEADY, 100 + rnd, args.workdir / f"{side}-{rnd}-steady.json")[0]
    m = steady["metrics"]
    mixed = bench(
        url,
        [*MIXED, "--request-rate", args.rates],
        200 + rnd,
        args.workdir / f"{side}-{rnd}-mixed.json",
    )
    attained = [(p["request_rate"], p["metrics"]["slo_attainment"]) for p in mixed]
    return {
        "side": side,
        "round": rnd,
        "out_tok_s": m["output_throughput"],
        "ttft_p50": m["ttft"]["p50"],
        "tpot_p50": m["tpot"]["p50"],
        "itl_p99": m["itl"]["p99"],
        "mixed_attainment": attained,
        "mixed_goodput": goodput(attained, 0.9) or 0.0,
    }


def picked(logfile: Path) -> str:
    for line in logfile.read_text(errors="replace").splitlines():
        if line.startswith("[up] mode: "):
            return line.removeprefix("[up] mode: ").split(" ", 1)[0].rstrip(",")
    return "?"


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| side | round | W16 out tok/s | TTFT p50 s | TPOT p50 ms | ITL p99 ms "
        "| mixed: SLO met per rate | mixed goodput req/s |",
        "|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        met = ", ".join(f"{a:.0%} at {rate:g}" for rate, a in r["mixed_attainment"])
        lines.append(
            f"| {r['side']} | {r['round']} | {r['out_tok_s']:.1f} | {r['ttft_p50']:.2f} "
            f"| {r['tpot_p50'] * 1000:.0f} | {r['itl_p99'] * 1000:.0f} | {met} "
            f"| {r['mixed_goodput']:g} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sides", default=",".join(SIDES), help="comma-separated, of " + str(SIDES))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--rates", default="1,1.5,2,2.5", help="the mixed workload's request rates")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/tandem-default-mode"))
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    sides = args.sides.split(",")
    for rnd in range(1, args.rounds + 1):
        turn = (rnd - 1) % len(sides)  # each round starts one side later: no side always first
        for side in sides[turn:] + sides[:turn]:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            logfile = args.workdir / f"{side}-{rnd}.log"
            proc = start_tandem(port, "float32", logfile, SIDES[side])
            try:
                started = time.monotonic()
                wait_ready(url + "/readyz", proc, READY_TIMEOUT)
                mode = picked(logfile)
                print(f"[{side}] round {rnd}: mode {mode}, ready after "
                      f"{time.monotonic() - started:.0f}s", flush=True)  # fmt: skip
                row = measure(side, url, rnd, args)
                row["side"] = f"{side} ({mode})" if side == "default" else side
                rows.append(row)
                print(table([row]).splitlines()[-1], flush=True)
            finally:
                stop(proc)
    print(f"\nCPU: {cpu_name()}; flags: {' '.join(cpu_flags())}; SmolLM2-135M float32\n")
    print(table(rows))
    (args.workdir / "summary.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
