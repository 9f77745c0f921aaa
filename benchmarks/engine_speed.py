"""Engine speed switches side by side (issue 24): a decode step at batch 1, 16 and 32 and a
prefill, with each optimisation off and on, measured in one run with the configurations
interleaved round by round (machines here are noisy; only same-run ratios mean much).

    .venv/bin/python benchmarks/engine_speed.py [--rounds 3] [--context 256] [--dtype float32]

Configurations:
- base: the modules' own projections, denormals kept (the engine before issue 24);
- fused: q/k/v and gate/up as one GEMM each (`EngineConfig.fuse_projections`);
- denormal: `torch.set_flush_denormal(True)` (denormal floats read as zero: SiLU's tail
  and tiny products no longer take the slow path);
- both.
Prints the host's CPU flags, medians over rounds, and each configuration's ratio to base.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import time
from collections import defaultdict

import torch

from shared.bus.params import SamplingParams
from shared.engine.engine import Engine, EngineConfig
from shared.model.loader import LoadedModel, load_model

CONFIGS = {"base": (False, False), "fused": (True, False), "denormal": (False, True)}
CONFIGS["both"] = (True, True)
BATCHES = (1, 16, 32)


def cpu_flags() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    flags = next((line for line in out.splitlines() if line.startswith("Flags")), "")
    keep = [f for f in flags.split() if f.startswith(("avx512", "amx")) or f == "avx2"]
    return " ".join(sorted(set(keep)))


def decode_step(model: LoadedModel, fuse: bool, batch: int, context: int, steps: int) -> float:
    """Median seconds of a decode step of `batch` sequences at about `context` tokens."""
    rng = random.Random(batch)
    engine = Engine(
        model,
        EngineConfig(num_blocks=batch * (context // 16 + 8) + 16, fuse_projections=fuse),
    )
    params = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([rng.randrange(100, 40000) for _ in range(context)], params)
    while engine.stats.decode_steps == 0:
        engine.step()  # the prompts' prefill first
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def prefill(model: LoadedModel, fuse: bool, prompts: int, tokens: int) -> float:
    rng = random.Random(7)
    engine = Engine(
        model, EngineConfig(num_blocks=prompts * tokens // 16 + 16, fuse_projections=fuse)
    )
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    batch = [
        (f"p{i}", [rng.randrange(100, 40000) for _ in range(tokens)], params)
        for i in range(prompts)
    ]
    t = time.perf_counter()
    engine.prefill_and_export(batch)
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    print(f"CPU flags: {cpu_flags()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    model = load_model(None, dtype=args.dtype, device="cpu")
    results: dict[tuple[str, str], list[float]] = defaultdict(list)
    names = list(CONFIGS)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate the order
            fuse, flush = CONFIGS[name]
            torch.set_flush_denormal(flush)
            for b in BATCHES:
                step = decode_step(model, fuse, b, args.context, args.steps)
                results[(name, f"decode b{b}")].append(step)
            results[(name, "prefill 4x256")].append(prefill(model, fuse, 4, 256))
            results[(name, "prefill 1x1024")].append(prefill(model, fuse, 1, 1024))
    torch.set_flush_denormal(False)
    cases = [f"decode b{b}" for b in BATCHES] + ["prefill 4x256", "prefill 1x1024"]
    print(f"\nmedian ms over {args.rounds} rounds ({args.dtype}, context {args.context})\n")
    print("| case | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for case in cases:
        base = statistics.median(results[("base", case)])
        cells = []
        for name in names:
            v = statistics.median(results[(name, case)])
            cells.append(f"{v * 1000:.1f}" + ("" if name == "base" else f" ({base / v:.2f}x)"))
        print(f"| {case} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
