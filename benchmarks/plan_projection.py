"""Projection to GPU clusters (issue 22): for H100 and H200 nodes x an 8B and a 70B
Llama-shaped model x a 4K-prompt/256-output workload and a chat-like one, `tandem plan
project` synthesises a roofline profile and `tandem plan search` simulates every colocated
and P:D deployment within a budget of instances; the table shows the best colocated and
the best split by goodput per GPU. Every figure is a projection (roofline costs, the real
router and scheduler deciding).

    .venv/bin/python benchmarks/plan_projection.py [--max-nodes 6] [--num-requests 150]

An instance is 1 GPU for the 8B and 4 GPUs (tensor-parallel, ideal scaling) for the 70B;
its KV pool is 90% of the memory its weights leave free. Engine options are GPU-like:
256 sequences, a 2,048-token step budget and chunks (chunked prefill on every decode
node), 16,384 batched tokens for a prefill node.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

MODELS = {"llama-8b": (1, 16.1e9), "llama-70b": (4, 141.1e9)}  # GPUs, weight bytes
MEMORY = {"h100": 80e9, "h200": 141e9}
# name: (prompt, output, target request rate per model: 8B, 70B)
WORKLOADS = {
    "4K/256": ("4096", "256", {"llama-8b": 24.0, "llama-70b": 10.0}),
    "chat": ("uniform:200:1000", "uniform:100:300", {"llama-8b": 100.0, "llama-70b": 30.0}),
}
FACTORS = (0.5, 0.75, 1.0, 1.25, 1.5)


def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "tandem.cli", *argv], capture_output=True, text=True, check=False
    )
    if proc.returncode not in (0, 1):  # search exits 1 when nothing meets the SLOs
        raise SystemExit(f"{' '.join(argv[:3])} failed: {proc.stderr[-2000:]}")
    return proc


def best(cands: list[dict], colocated: bool, gpus: int) -> tuple[str, float]:  # type: ignore[type-arg]
    pool = [c for c in cands if c["deployment"].startswith("colocated") == colocated]
    top = max(pool, key=lambda c: (c["goodput"] or 0.0) / c["nodes"])
    return top["deployment"], (top["goodput"] or 0.0) / (top["nodes"] * gpus)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-nodes", type=int, default=6)
    p.add_argument("--num-requests", type=int, default=150)
    p.add_argument("--slo-ttft", type=float, default=1.0)
    p.add_argument("--slo-tpot", type=float, default=0.05)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tandem-projection-"))
    print(
        f"SLOs: TTFT {args.slo_ttft} s, TPOT {args.slo_tpot} s, 90% attainment; "
        f"up to {args.max_nodes} instances; all figures are projections\n"
    )
    print(
        "| hardware | model | workload | best colocated | req/s/GPU | best split | req/s/GPU "
        "| split / colocated | recommended |"
    )
    print("|---|---|---|---|---:|---|---:|---:|---|")
    for hw in MEMORY:
        for model, (gpus, weights) in MODELS.items():
            prof = tmp / f"{hw}-{model}.json"
            run(["plan", "project", "--hardware", hw, "--model-config", model,
                 "--gpus", str(gpus), "--output", str(prof)])  # fmt: skip
            kv_mb = int((MEMORY[hw] * gpus - weights) * 0.9 / 1e6)
            for name, (prompt, output, targets) in WORKLOADS.items():
                rates = ",".join(f"{targets[model] * f:g}" for f in FACTORS)
                out = tmp / f"{hw}-{model}-{name.replace('/', '-')}.json"
                run([
                    "plan", "search", "--profile", str(prof), "--max-nodes", str(args.max_nodes),
                    "--prompt-len", prompt, "--output-len", output, "--request-rate", rates,
                    "--num-requests", str(args.num_requests), "--kv-cache-mb", str(kv_mb),
                    "--max-num-seqs", "256", "--max-batched-tokens", "16384",
                    "--step-token-budget", "2048", "--prefill-chunk-tokens", "2048",
                    "--slo-ttft", str(args.slo_ttft), "--slo-tpot", str(args.slo_tpot),
                    "--output", str(out), "--quiet",
                ])  # fmt: skip
                doc = json.loads(out.read_text())
                col, col_g = best(doc["candidates"], True, gpus)
                spl, spl_g = best(doc["candidates"], False, gpus)
                ratio = f"{spl_g / col_g:.2f}x" if col_g else "-"
                rec = (doc["recommendation"] or {}).get("deployment", "none")
                print(
                    f"| {hw} | {model} | {name} | {col} | {col_g:.2f} | {spl} | {spl_g:.2f} "
                    f"| {ratio} | {rec} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
