"""Engine benchmark: HF `generate` vs Tandem single stream vs continuous batching, and prefill;
and `--decode-steps`: a float32 decode step at batch 1, 16 and 32, and a prefill of 4 x 256
tokens, with the portable torch ops (gather + SDPA, transformers' modules, torch's linear),
the CPU kernels (shared/model/cpu_kernels.py: paged attention, fused norms, rotary and
SiLU), the kernels with the linear layers through oneDNN (shared/model/cpu_gemm.py), and
the kernels with each linear layer's library chosen per size (`TANDEM_CPU_GEMM=auto`, the
default: torch's linear for the few rows where it timed faster, oneDNN otherwise).

Every configuration runs once per round and the order rotates between rounds (A/B
interleaving), so machine noise spreads over all of them; the table shows medians over rounds
and ratios to HF `generate` single stream in the same dtype, measured in the same run.

    python benchmarks/engine.py [--dtypes float32,bfloat16] [--rounds 3] [--new-tokens 48]
    python benchmarks/engine.py --decode-steps [--rounds 5] [--context 256]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

from shared.engine.engine import Engine, EngineConfig
from shared.model import cpu_gemm
from shared.model.loader import LoadedModel, load_model
from shared.sampling_params import SamplingParams
from tandem.plan.profile import cpu_flags

PROMPT = (
    "Once upon a time there was a little robot who wanted to learn how to paint. "
    "Every morning it rolled to the window and looked at the sky, trying to remember"
)


def hf_single(model: LoadedModel, prompt: list[int], n: int) -> tuple[float, float]:
    t = time.perf_counter()
    model.hf_model.generate(
        torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False
    )
    elapsed = time.perf_counter() - t
    return n / elapsed, elapsed / n


def tandem_batch(
    model: LoadedModel, prompts: list[list[int]], n: int, max_seqs: int
) -> tuple[float, float]:
    engine = Engine(model, EngineConfig(num_blocks=4096, max_num_seqs=max_seqs, detokenize=False))
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    step_times: list[float] = []
    t = time.perf_counter()
    while engine.has_unfinished():
        s = time.perf_counter()
        is_decode = not engine.scheduler.waiting
        engine.step()
        if is_decode:
            step_times.append(time.perf_counter() - s)
    elapsed = time.perf_counter() - t
    return len(prompts) * n / elapsed, statistics.median(step_times)


def prefill_rate(model: LoadedModel, engine: Engine, length: int, hf: bool) -> float:
    ids = (model.encode(PROMPT) * (length // 10 + 1))[:length]
    if hf:
        t = time.perf_counter()
        with torch.inference_mode():
            model.hf_model(torch.tensor([ids]), logits_to_keep=1)
        return length / (time.perf_counter() - t)
    engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0))
    t = time.perf_counter()
    engine.step()
    return length / (time.perf_counter() - t)


def decode_step_ms(engine: Engine, batch: int, context: int, steps: int) -> float:
    """Median decode-step time with `batch` sequences at about `context` tokens."""
    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request([100 + (i * 7 + j) % 30000 for j in range(context)], params)
    while engine.scheduler.waiting:
        engine.step()  # the prefills
    times = []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def prefill_ms(engine: Engine, prompts: int, length: int) -> float:
    """One engine step prefilling `prompts` new prompts of `length` tokens together."""
    params = SamplingParams(max_tokens=1, temperature=0)
    for i in range(prompts):
        engine.add_request([100 + (i * 11 + j) % 30000 for j in range(length)], params)
    t = time.perf_counter()
    engine.step()
    elapsed = (time.perf_counter() - t) * 1000
    while engine.has_unfinished():
        engine.step()
    return elapsed


def decode_steps(args: argparse.Namespace) -> None:
    model = load_model(None, dtype="float32", device="cpu")
    config = EngineConfig(
        num_blocks=4096, max_num_seqs=64, detokenize=False, enable_prefix_caching=False
    )
    os.environ[cpu_gemm.ENV_SWITCH] = "onednn"
    onednn, fused, portable = (Engine(model, config) for _ in range(3))
    os.environ[cpu_gemm.ENV_SWITCH] = "auto"
    auto = Engine(model, config)
    if onednn.runner.kernels is None:
        raise SystemExit("the CPU kernels are unavailable here (see the log)")
    if all(f is m for m, f in onednn.runner.linear.items()):
        raise SystemExit("the oneDNN GEMMs are unavailable here (torch build)")
    for engine in (fused, portable):  # torch's own linear
        engine.runner.linear = {m: m for m in engine.runner.linear}
    portable.runner.kernels = None
    engines = {
        "portable ops": portable,
        "CPU kernels": fused,
        "kernels + oneDNN": onednn,
        "kernels + auto": auto,
    }
    print("auto: torch's linear up to these rows per weight shape (out, in, bias):",
          cpu_gemm._TUNED)  # fmt: skip
    samples: dict[tuple[str, str], list[float]] = defaultdict(list)
    cases: list[tuple[str, str, Callable[[Engine], float]]] = [
        (name, f"decode b{b}", lambda e, b=b: decode_step_ms(e, b, args.context, 8))
        for b in args.decode_batches
        for name in engines
    ]
    cases += [(name, "prefill 4x256", lambda e: prefill_ms(e, 4, 256)) for name in engines]
    for name, _, run in cases[: len(engines)]:
        run(engines[name])  # warm-up
    for r in range(args.rounds):
        for name, case, run in cases[r % len(cases) :] + cases[: r % len(cases)]:
            samples[(name, case)].append(run(engines[name]))
            print(
                f"  [round {r + 1}] {name}, {case}: {samples[(name, case)][-1]:.1f} ms", flush=True
            )
    print(f"\nCPU flags: {' '.join(cpu_flags())}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, float32, context ~{args.context}\n")  # fmt: skip
    names = list(engines)
    print("| case | " + " | ".join(f"{n} ms" for n in names) + " | kernels / portable "
          "| oneDNN / kernels | auto / oneDNN |")  # fmt: skip
    print("|---|" + "---:|" * (len(names) + 3))
    for case in dict.fromkeys(c for _, c, _ in cases):
        g, k, o, a = (statistics.median(samples[(n, case)]) for n in names)
        print(f"| {case} | {g:.1f} | {k:.1f} | {o:.1f} | {a:.1f} | {g / k:.2f}x | {k / o:.2f}x "
              f"| {o / a:.2f}x |")  # fmt: skip


def run_dtype(dtype: str, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    model = load_model(None, dtype=dtype, device="cpu")
    prefill_engine = Engine(
        model, EngineConfig(num_blocks=512, detokenize=False, enable_prefix_caching=False)
    )
    base = model.encode(PROMPT)
    prompts = [[*base, 100 + i] for i in range(max(args.concurrency))]
    n = args.new_tokens
    cases: dict[str, Callable[[], tuple[float, float]]] = {
        "HF generate, 1 stream": lambda: hf_single(model, base, n),
        "Tandem, 1 stream": lambda: tandem_batch(model, prompts[:1], n, 1),
    }
    for c in args.concurrency:
        cases[f"Tandem CB, {c} concurrent"] = lambda c=c: tandem_batch(model, prompts[:c], n, c)
    for length in args.prefill_lengths:
        cases[f"prefill {length} tok, HF forward"] = lambda L=length: (
            prefill_rate(model, prefill_engine, L, True),
            0.0,
        )
        cases[f"prefill {length} tok, Tandem"] = lambda L=length: (
            prefill_rate(model, prefill_engine, L, False),
            0.0,
        )
    tandem_batch(model, prompts[:4], 4, 4)  # warm-up: first-call allocations
    hf_single(model, base, 4)
    samples: dict[str, list[tuple[float, float]]] = defaultdict(list)
    names = list(cases)
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            samples[name].append(cases[name]())
            print(f"  [{dtype} round {r + 1}] {name}: {samples[name][-1][0]:.1f}", flush=True)
    return {
        name: {
            "tokens_per_s": statistics.median(v[0] for v in vals),
            "step_ms": statistics.median(v[1] for v in vals) * 1000,
        }
        for name, vals in samples.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--concurrency", default="1,4,8,16,32")
    parser.add_argument("--prefill-lengths", default="128,512,2048")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    parser.add_argument("--decode-steps", action="store_true", help="the attention A/B only")
    parser.add_argument("--decode-batches", default="1,16,32")
    parser.add_argument("--context", type=int, default=256)
    args = parser.parse_args()
    if args.decode_steps:
        torch.set_num_threads(args.threads)
        args.decode_batches = [int(b) for b in args.decode_batches.split(",")]
        decode_steps(args)
        return
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.prefill_lengths = [int(c) for c in args.prefill_lengths.split(",")]
    torch.set_num_threads(args.threads)
    results = {d: run_dtype(d, args) for d in args.dtypes.split(",")}
    print()
    print("| dtype | configuration | tokens/s (median) | × HF 1 stream | step ms (median) |")
    print("|---|---|---:|---:|---:|")
    for dtype, rows in results.items():
        hf = rows["HF generate, 1 stream"]["tokens_per_s"]
        hf_prefill = {
            k.split(" tok")[0]: v["tokens_per_s"] for k, v in rows.items() if "HF forward" in k
        }
        for name, row in rows.items():
            ref = hf_prefill[name.split(" tok")[0]] if name.startswith("prefill") else hf
            print(
                f"| {dtype} | {name} | {row['tokens_per_s']:.1f} | "
                f"{row['tokens_per_s'] / ref:.2f}× | {row['step_ms']:.1f} |"
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
