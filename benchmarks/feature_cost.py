"""What features cost requests that do not use them: the engine at HEAD against the engine
at a base commit (before the features), side by side, on plain greedy requests.

Both commits are checked out into temporary git worktrees side by side (the same kind of
directory for each: run from the checkout itself, one and the same commit measured 0.91x
against its own worktree copy); each round runs the same workload once in each tree
(separate processes, the order alternating between rounds), so machine noise spreads over
both. `--head` equal to `--base` is the control: its ratio shows what the method alone
gives. The workload: `--batch` requests of a 128-token prompt,
`--tokens` output tokens each, continuous batching with detokenisation on (as a node
runs), no logprobs, no echo, no response format. The table shows medians over rounds of
output tokens/s and of the decode step, and the ratio HEAD/base.

    python benchmarks/feature_cost.py --base b409563 [--head HEAD] [--rounds 5] [--batch 16]
        [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Run inside each tree (its own `shared` package): only APIs both commits have.
WORKLOAD = """
import json, statistics, sys, time
from shared.sampling_params import SamplingParams
from shared.engine.engine import Engine, EngineConfig
from shared.model.loader import load_model

batch, tokens = int(sys.argv[1]), int(sys.argv[2])
model = load_model(None, dtype="float32", device="cpu")
engine = Engine(model, EngineConfig(num_blocks=4096, max_num_seqs=64))
params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
warm = engine.add_request([11] * 32, SamplingParams(max_tokens=4, temperature=0))
while engine.has_unfinished():
    engine.step()
for i in range(batch):
    engine.add_request([100 + (i * 7 + j) % 30000 for j in range(128)], params)
steps, start = [], time.perf_counter()
while engine.has_unfinished():
    decoding = not engine.scheduler.waiting
    t = time.perf_counter()
    engine.step()
    if decoding:
        steps.append(time.perf_counter() - t)
elapsed = time.perf_counter() - start
print(json.dumps({"tok_s": batch * tokens / elapsed, "step_ms": statistics.median(steps) * 1e3}))
"""


def run(tree: Path, batch: int, tokens: int) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run(
        [sys.executable, "-c", WORKLOAD, str(batch), str(tokens)],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the commit before the features")
    ap.add_argument("--head", default="HEAD", help="the commit with them (default HEAD)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from tandem.plan.profile import cpu_flags

    head, base = f"head {args.head}", f"base {args.base}"
    with tempfile.TemporaryDirectory(prefix="tandem-feature-cost-") as tmp:
        trees = {head: Path(tmp) / "head", base: Path(tmp) / "base"}
        for tree, commit in zip(trees.values(), (args.head, args.base), strict=True):
            subprocess.run(
                ["git", "worktree", "add", "--detach", str(tree), commit],
                cwd=ROOT, check=True, capture_output=True,
            )  # fmt: skip
        try:
            results: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
            order = list(trees)
            for r in range(args.rounds):
                for name in order if r % 2 == 0 else order[::-1]:
                    results[name].append(run(trees[name], args.batch, args.tokens))
                    print(f"  [round {r + 1}] {name}: {results[name][-1]}", flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(
                    ["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False
                )
    print(f"\nCPU flags: {' '.join(cpu_flags())}")
    print(f"{args.batch} plain greedy requests x {args.tokens} tokens, medians of {args.rounds}\n")
    print("| tree | output tok/s | decode step ms |")
    print("|---|---:|---:|")
    med = {
        name: (
            statistics.median(r["tok_s"] for r in rs),
            statistics.median(r["step_ms"] for r in rs),
        )
        for name, rs in results.items()
    }
    for name, (tok_s, step) in med.items():
        print(f"| {name} | {tok_s:.1f} | {step:.1f} |")
    (head_tok, head_step), (base_tok, base_step) = med[head], med[base]
    print(f"| HEAD/base | {head_tok / base_tok:.3f}x | {head_step / base_step:.3f}x |")


if __name__ == "__main__":
    main()
