"""Where a decode step and a prefill spend their time (issue 24's first step), per kind of op.

    .venv/bin/python benchmarks/profile_step.py [--batch 16] [--prompt 256] [--threads 2]

Runs the real model (float32) through the engine: `--batch` prompts of `--prompt` tokens are
prefilled, then decode steps run with `torch.profiler` on. Prints, for a decode step and
for the prefill, the time per step and its split into GEMMs, attention, paged-KV gather and
write, norms, rotary, the LM head, other ops, and what no op accounts for (Python between
ops); and the engine's time around the forward (scheduling, sampling, detokenisation).
"""

from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from shared.engine.engine import Engine, EngineConfig
from shared.model.loader import load_model
from shared.sampling_params import SamplingParams
from tandem.plan.profile import cpu_flags

# aten op name → category; first match wins (checked in order)
CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    (
        "attention",
        ("scaled_dot_product", "_scaled_dot", "flash_attention", "_efficient_attention"),
    ),
    ("attention (paged kernel)", ("tandem::paged_decode_attention",)),
    ("fused norm, rotary, SiLU", ("tandem::",)),
    ("KV gather", ("index_select", "gather", "embedding")),
    ("KV write", ("index_copy", "index_put", "scatter")),
    ("GEMM", ("addmm", "aten::mm", "aten::bmm", "matmul", "aten::linear", "_linear_pointwise")),
    ("norm", ("pow", "mean", "rsqrt")),
    ("rotary", ("aten::cat", "aten::neg", "aten::slice")),
    ("elementwise", ("aten::mul", "aten::add", "silu", "aten::sub", "aten::div")),
]


OPS = ("aten::", "tandem::", "mkldnn::")  # leaf op namespaces (mkldnn: cpu_gemm.py's GEMMs)


def category(name: str) -> str:
    for cat, keys in CATEGORIES:
        if any(k in name for k in keys):
            return cat
    return "other ops"


def profile_calls(fn: Callable[[], object], steps: int) -> tuple[float, dict[str, float]]:
    """Wall ms per call, and self-CPU ms per call by category (leaf ops only)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        wall = (time.perf_counter() - start) * 1000 / steps
    by_cat: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        if event.key.startswith(OPS) and event.self_cpu_time_total > 0:
            by_cat[category(event.key)] += event.self_cpu_time_total / 1000 / steps
    return wall, dict(by_cat)


def report(title: str, wall: float, by_cat: dict[str, float]) -> None:
    print(f"\n{title}: {wall:.1f} ms per call")
    accounted = sum(by_cat.values())
    rows = sorted(by_cat.items(), key=lambda kv: -kv[1])
    rows.append(("(no op: Python, dispatch)", max(0.0, wall - accounted)))
    for name, ms in rows:
        print(f"  {name:<28} {ms:8.2f} ms  {100 * ms / wall:5.1f}%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(None, dtype="float32", device="cpu")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 49152) for _ in range(args.prompt)] for _ in range(args.batch)]
    params = SamplingParams(max_tokens=512, temperature=0, ignore_eos=True)
    print(f"CPU flags: {' '.join(cpu_flags())}; torch {torch.__version__}, {args.threads} threads")

    engine = Engine(model, EngineConfig(num_blocks=2048, detokenize=True))
    for p in prompts:
        engine.add_request(p, params)
    wall, cats = profile_calls(engine.step, 1)  # the whole batch's prefill, one forward
    report(f"prefill of {args.batch} x {args.prompt} tokens (engine.step)", wall, cats)
    for _ in range(5):
        engine.step()  # warm the decode path
    wall, cats = profile_calls(engine.step, args.steps)
    report(f"decode step, batch {args.batch}, context ~{args.prompt + 5} (engine.step)", wall, cats)

    # The forward alone on the same batch: what the engine adds around it.
    seqs = engine.scheduler.running

    def forward() -> None:
        engine.runner.forward_decode(
            [s.last_token for s in seqs],
            [s.num_tokens - 1 for s in seqs],
            [s.block_ids for s in seqs],
        )

    start = time.perf_counter()
    for _ in range(args.steps):
        forward()
    fwd = (time.perf_counter() - start) * 1000 / args.steps
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step = (time.perf_counter() - start) * 1000 / args.steps
    around = step - fwd
    print(f"\nforward_decode alone {fwd:.1f} ms; engine.step {step:.1f} ms: the engine loop")
    print(f"around it (schedule, sample, detokenise) {around:.1f} ms")


if __name__ == "__main__":
    main()
