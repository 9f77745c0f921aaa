"""Chunked prefill on one engine: what a long prompt arriving mid-decode costs the running
streams (their gaps between tokens) and itself (time to its first token), classic schedule
against per-step token budgets, measured side by side in one run.

    .venv/bin/python benchmarks/chunked_prefill.py [--streams 8] [--long 1500] [--rounds 2]

Each round and configuration: `--streams` short requests start and decode; once they have
made 8 tokens each, a `--long`-token prompt joins. Measured from its arrival until its
first token: the running streams' longest and median gap between tokens, the long
prompt's time to first token, and the decode tokens made in that window per second.
Prints the host's CPU flags; medians over rounds.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from shared.engine.engine import Engine, EngineConfig
from shared.model.loader import load_model
from shared.sampling_params import SamplingParams
from tandem.plan.profile import cpu_flags

BUDGETS = [0, 64, 128, 256, 512]  # 0: classic (prefill whole, then decode)


def one_round(
    model: object, budget: int, streams: int, long_len: int, seed: int
) -> dict[str, float]:
    rng = random.Random(seed)
    config = EngineConfig(
        num_blocks=1024, step_token_budget=budget, prefill_chunk_tokens=max(budget, 16)
    )
    engine = Engine(model, config)  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=4000 // 2, temperature=0, ignore_eos=True)
    for _ in range(streams):
        engine.add_request([rng.randrange(3, 49152) for _ in range(32)], params)
    last: dict[str, float] = {}
    made: dict[str, int] = {}
    while min(made.values(), default=0) < 8 or len(made) < streams:
        now = time.perf_counter()
        for out in engine.step():
            made[out.request_id] = made.get(out.request_id, 0) + 1
            last[out.request_id] = now
    long_prompt = [rng.randrange(3, 49152) for _ in range(long_len)]
    arrived = time.perf_counter()
    long_id = engine.add_request(long_prompt, SamplingParams(max_tokens=4, temperature=0))
    last = dict.fromkeys(last, arrived)
    gaps: list[float] = []
    decoded = 0
    while True:
        outs = engine.step()
        now = time.perf_counter()
        done = False
        for out in outs:
            if out.request_id == long_id:
                done = True
                continue
            gaps.append(now - last[out.request_id])
            last[out.request_id] = now
            decoded += 1
        if done:
            break
    window = time.perf_counter() - arrived
    return {
        "ttft": window,
        "max_gap": max(gaps) if gaps else window,
        "p50_gap": statistics.median(gaps) if gaps else window,
        "tok_s": decoded / window,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--long", type=int, default=1500)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(None, dtype="float32", device="cpu")
    results: dict[int, list[dict[str, float]]] = {b: [] for b in BUDGETS}
    for r in range(args.rounds):
        for budget in BUDGETS:  # interleaved: each round runs every configuration
            results[budget].append(one_round(model, budget, args.streams, args.long, r))
            print(f"round {r} budget {budget}: {results[budget][-1]}", flush=True)
    flags = " ".join(cpu_flags())
    print(f"\nCPU flags: {flags}; {args.streams} streams, a {args.long}-token prompt, "
          f"{args.threads} threads, median of {args.rounds} rounds")  # fmt: skip
    print(
        f"{'budget':>8} {'long TTFT s':>12} {'max gap s':>10} {'p50 gap s':>10}"
        f" {'decode tok/s':>13}"
    )
    base = statistics.median(x["ttft"] for x in results[0])
    for budget in BUDGETS:
        rows = results[budget]
        med = {k: statistics.median(x[k] for x in rows) for k in rows[0]}
        name = "classic" if budget == 0 else str(budget)
        print(
            f"{name:>8} {med['ttft']:>12.2f} {med['max_gap']:>10.3f} {med['p50_gap']:>10.3f} "
            f"{med['tok_s']:>13.1f}   TTFT x{med['ttft'] / base:.2f}"
        )


if __name__ == "__main__":
    main()
