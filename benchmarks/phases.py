"""Each phase's cost on one and on two torch threads, with profiles: the "why" of
`tandem bench compare` (issue 8), measured in-process on the real model.

The disaggregated side of the comparison pins one prefill and one decode node to a core
each (one torch thread); the colocated side runs both phases in one engine on both cores.
This prints, per phase of the comparison's workload (20% 1,500-token prompts, the rest
100, 128 output tokens), the time on 1 and on 2 threads, medians over interleaved rounds,
and the top operators of each phase on one thread (`torch.profiler`, self CPU time).

    python benchmarks/phases.py [--rounds 3] [--long 1500] [--short 100]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from shared.engine.engine import Engine, EngineConfig
from shared.model.loader import LoadedModel, load_model
from shared.sampling_params import SamplingParams

DECODE_STEPS = 8


def prompt(model: LoadedModel, n: int, salt: int) -> list[int]:
    """n token ids no other prompt shares a block with (prefix caching is off anyway)."""
    vocab = int(model.config.vocab_size)
    return [(salt * 7919 + i * 104_729) % (vocab - 1000) + 500 for i in range(n)]


def engine_for(model: LoadedModel) -> Engine:
    # Room for the largest case (1,564 + 512 and 3 x (164 + 512) tokens): ~240 MB of KV.
    config = EngineConfig(num_blocks=320, detokenize=False, enable_prefix_caching=False)
    return Engine(model, config)


def prefill_ready(model: LoadedModel, length: int, salt: int) -> Engine:
    """An engine whose next step is one prompt's prefill (what a prefill node does per job)."""
    engine = engine_for(model)
    engine.add_request(prompt(model, length, salt), SamplingParams(max_tokens=1, temperature=0))
    return engine


def prefill(model: LoadedModel, length: int, salt: int) -> float:
    engine = prefill_ready(model, length, salt)
    t = time.perf_counter()
    engine.step()
    return time.perf_counter() - t


def decode_batch(model: LoadedModel, contexts: list[int], salt: int) -> Engine:
    """An engine whose sequences have been prefilled: the next steps are decode steps."""
    engine = engine_for(model)
    params = SamplingParams(max_tokens=512, temperature=0, ignore_eos=True)
    for i, n in enumerate(contexts):
        engine.add_request(prompt(model, n, salt + i), params)
    while engine.scheduler.waiting:
        engine.step()
    engine.step()
    return engine


def decode_step(model: LoadedModel, contexts: list[int], salt: int) -> float:
    """Median seconds of a decode step over these contexts (what a decode node does)."""
    engine = decode_batch(model, contexts, salt)
    times = []
    for _ in range(DECODE_STEPS):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def top_ops(fn: Callable[[], object], n: int = 5) -> list[tuple[str, float]]:
    """The n operators with the most self CPU time in one call of fn, as shares of it."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    return [(e.key, e.self_cpu_time_total / total) for e in events[:n]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--long", type=int, default=1500)
    parser.add_argument("--short", type=int, default=100)
    args = parser.parse_args()
    model = load_model(None, dtype="float32", device="cpu")
    # A decode batch as the comparison's decode node sees it at ~0.1 req/s: one long
    # context among short ones (the 128 output tokens are part-way through).
    mix = [args.long + 64] + [args.short + 64] * 3
    cases: dict[str, Callable[[int], float]] = {
        f"prefill, {args.long}-token prompt": lambda s: prefill(model, args.long, s),
        f"prefill, {args.short}-token prompt": lambda s: prefill(model, args.short, s),
        f"decode step, 4 seqs, contexts {mix}": lambda s: decode_step(model, mix, s),
        "decode step, 4 seqs, short contexts": lambda s: decode_step(
            model, [args.short + 64] * 4, s
        ),
    }
    for threads in (1, 2):  # warm-up: first-call allocations
        torch.set_num_threads(threads)
        prefill(model, 64, 0)
    samples: dict[tuple[str, int], list[float]] = {}
    salt = 1
    for r in range(args.rounds):
        for name, fn in cases.items():
            for threads in (1, 2) if r % 2 == 0 else (2, 1):
                torch.set_num_threads(threads)
                salt += 10
                samples.setdefault((name, threads), []).append(fn(salt))
                gc.collect()  # each case's engine and its KV go now, not some cases later
        print(f"  round {r + 1} done", flush=True)
    print()
    print("| phase | 1 thread s | 2 threads s | 2-thread speed-up |")
    print("|---|---:|---:|---:|")
    for name in cases:
        one = statistics.median(samples[(name, 1)])
        two = statistics.median(samples[(name, 2)])
        print(f"| {name} | {one:.3f} | {two:.3f} | {one / two:.2f}× |")
    torch.set_num_threads(1)
    profiled = {
        f"prefill, {args.long}-token prompt": prefill_ready(model, args.long, 99),
        f"decode step, contexts {mix}": decode_batch(model, mix, 199),
    }
    for name, engine in profiled.items():
        print()
        print(f"Top operators, {name}, 1 thread (share of self CPU time):")
        for key, share in top_ops(engine.step):
            print(f"- {key}: {share:.0%}")


if __name__ == "__main__":
    main()
