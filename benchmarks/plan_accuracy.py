"""The planner's accuracy on this machine: `tandem plan validate` for each deployment x
workload cell, then one table of the simulator's relative errors (TTFT p50/p90, TPOT p50,
output tokens/s) and their median.

    .venv/bin/python benchmarks/plan_accuracy.py --profile-2t full-t2.json \\
        --profile-1t full-t1.json [--cells colocated1:short,split:mixed,...] [--out DIR]
        [--replay]

`--replay` measures nothing: it re-simulates the measured runs already in DIR (their
requests at their send times) with the simulator as it is now, and prints the errors.

Deployments (the same 2 cores each time):
- colocated1: one decode node prefilling everything, 2 threads (profile measured with
  `tandem plan profile --threads 2`);
- split: 1 prefill + 1 decode node, a core and a thread each (`--threads 1` profile);
- colocated2: two decode nodes prefilling their own requests, a core each (`--threads 1`).
Workloads (`bench serve` syntax): short (100-token prompts), mixed (20% 1,500 / 80% 100),
long (50% 1,500); 32 output tokens, two request rates each, sized so that the lower is
light and the higher loads the deployment. Prints the host's CPU flags first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tandem.plan.profile import cpu_flags
from tandem.plan.validate import error_json, point_errors

DEPLOYMENTS = {
    "colocated1": (["--colocated", "1"], "2t"),
    "split": (["--prefill", "1", "--decode", "1", "--pin-cores"], "1t"),
    "colocated2": (["--colocated", "2", "--pin-cores"], "1t"),
}
WORKLOADS = {
    "short": ("100", "0.5,2"),
    "mixed": ("mix:100:1500:0.2", "0.25,0.6"),
    "long": ("mix:100:1500:0.5", "0.15,0.35"),
}


def validate(cell: str, args: argparse.Namespace, out: Path) -> dict[str, object]:
    deployment, workload = cell.split(":")
    flags, threads = DEPLOYMENTS[deployment]
    prompt, rates = WORKLOADS[workload]
    profile = args.profile_2t if threads == "2t" else args.profile_1t
    doc_path = out / f"{deployment}-{workload}.json"
    argv = [
        sys.executable, "-m", "tandem.cli", "plan", "validate", "--profile", profile, *flags,
        "--transport", "tcp", "--prompt-len", prompt, "--output-len", str(args.output_len),
        "--request-rate", rates, "--num-requests", str(args.num_requests), "--duration", "120",
        "--warmup", "2", "--output", str(doc_path), "--quiet",
    ]  # fmt: skip
    started = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        print(proc.stdout[-2000:], proc.stderr[-2000:], file=sys.stderr)
        raise SystemExit(f"{cell}: validate failed ({proc.returncode})")
    doc = json.loads(doc_path.read_text())
    return {"cell": cell, "seconds": time.monotonic() - started, "errors": doc["errors"]}


def replay(cell: str, args: argparse.Namespace, out: Path) -> dict[str, object]:
    """The simulated side again, on the measured requests saved by an earlier run."""
    deployment, workload = cell.split(":")
    flags, threads = DEPLOYMENTS[deployment]
    profile = args.profile_2t if threads == "2t" else args.profile_1t
    measured_path = out / f"{deployment}-{workload}.json"
    sim_path = out / f"{deployment}-{workload}-replay.json"
    argv = [
        sys.executable, "-m", "tandem.cli", "plan", "simulate", "--profile", profile,
        *[f for f in flags if f != "--pin-cores"], "--trace", str(measured_path),
        "--output", str(sim_path), "--quiet",
    ]  # fmt: skip
    started = time.monotonic()
    subprocess.run(argv, capture_output=True, text=True, check=True)
    measured = json.loads(measured_path.read_text())["sweeps"][0]["points"]
    simulated = json.loads(sim_path.read_text())["sweeps"][0]["points"]
    rows = point_errors(
        [(p["request_rate"], p["metrics"]) for p in measured], [p["metrics"] for p in simulated]
    )
    return {"cell": cell, "seconds": time.monotonic() - started, "errors": error_json(rows)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile-2t", required=True)
    p.add_argument("--profile-1t", required=True)
    cells = [f"{d}:{w}" for w in WORKLOADS for d in DEPLOYMENTS]
    p.add_argument("--cells", default=",".join(cells))
    p.add_argument("--num-requests", type=int, default=20)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--out", default="plan-accuracy")
    p.add_argument("--replay", action="store_true", help="re-simulate the saved measured runs")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"CPU flags: {' '.join(cpu_flags())}")
    results = []
    for cell in args.cells.split(","):
        results.append(replay(cell, args, out) if args.replay else validate(cell, args, out))
        r = results[-1]
        print(f"[{cell}] {r['seconds']:.0f}s", file=sys.stderr, flush=True)
    print("| cell | rate | TTFT p50 | TTFT p90 | TPOT p50 | out tok/s |")
    print("|---|---:|---:|---:|---:|---:|")
    every = []
    for r in results:
        rows: dict[float, dict[str, float | None]] = {}
        for e in r["errors"]:  # type: ignore[attr-defined]
            rows.setdefault(e["request_rate"], {})[e["metric"]] = e["relative_error"]
            if e["relative_error"] is not None:
                every.append(abs(e["relative_error"]))
        for rate, errs in rows.items():
            cols = " | ".join(
                "-" if errs.get(m) is None else f"{errs[m]:+.0%}"
                for m in ("TTFT p50", "TTFT p90", "TPOT p50", "out tok/s")
            )
            print(f"| {r['cell']} | {rate:g} | {cols} |")
    if every:
        within = sum(1 for e in every if e <= 0.2)
        print(
            f"\nmedian |error| {statistics.median(every):.0%}; "
            f"{within}/{len(every)} figures within 20%"
        )
    name = "summary-replay.json" if args.replay else "summary.json"
    (out / name).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
