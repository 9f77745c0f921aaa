"""How fast `tandem plan simulate` simulates a large cluster: issue 22's target is a
simulated hour of a 64-node cluster at 300 requests/s (~1M requests) in under 60 s on one
core.

The cluster: 24 prefill + 40 decode nodes of the projected H100 profile with the 8B model
(`tandem plan project --hardware h100 --model-config llama-8b`), GPU-like engine options
(256 sequences, 16,384 batched tokens, a 40 GB KV pool, prefill batches of 16, whole
prefills), Poisson arrivals at `--rate`, prompts uniform 200-2,000 tokens, outputs 50-300.
It times the simulation and the metrics apart, for `--seconds` of simulated traffic, once
with steady decode runs (the default) and, unless `--runs-only`, once stepping one event a
step, and prints requests simulated per second of CPU and the time 1M requests would take.

    python benchmarks/simulator_speed.py [--seconds 30] [--rate 300] [--runs-only]
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0, help="simulated seconds of traffic")
    ap.add_argument("--rate", type=float, default=300.0, help="requests per simulated second")
    ap.add_argument("--runs-only", action="store_true", help="skip the stepwise simulation")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from tandem.plan import compiled

    compiled.activate()  # before the simulator's modules are imported (if built)
    from shared.costs.model import CostModel
    from tandem.bench.loadgen import arrival_times
    from tandem.bench.metrics import Slo, run_metrics
    from tandem.bench.workload import parse_lengths, sample_lengths
    from tandem.plan.profile import cpu_flags
    from tandem.plan.project import load_hardware, load_model_shape, project
    from tandem.plan.simengine import EngineShape
    from tandem.plan.simulator import Simulation
    from tandem.plan.topology import Arrival, Topology

    profile = project(load_hardware("h100"), load_model_shape("llama-8b"))
    costs = CostModel(profile)
    blocks = 40_000 * (1 << 20) // (profile.kv_bytes_per_token * 16)
    engine = EngineShape(
        num_blocks=blocks,
        max_num_seqs=256,
        max_num_batched_tokens=16384,
        enable_prefix_caching=False,  # as `tandem plan simulate` runs: no shared prefixes
    )
    topology = Topology(
        prefill=24,
        decode=40,
        decode_engine=engine,
        prefill_engine=engine,
        prefill_max_batch=16,
        admission_latency=0.05,
    )
    n = int(args.seconds * args.rate)
    lengths = sample_lengths(
        parse_lengths("uniform:200:2000"), parse_lengths("uniform:50:300"), n, "speed"
    )
    offsets = arrival_times(n, args.rate, "poisson", random.Random(1))
    arrivals = [Arrival(at, p, o) for (p, o), at in zip(lengths, offsets, strict=True)]

    print(f"CPU flags: {' '.join(cpu_flags())}")
    print(f"running {compiled.describe()}")
    print(f"{n} requests, {args.seconds:g} simulated s at {args.rate:g} req/s, 24P:40D H100\n")
    print("| mode | events | simulate s | metrics s | requests/s simulated | 1M requests |")
    print("|---|---:|---:|---:|---:|---:|")
    modes = [("steady runs", True)] + ([] if args.runs_only else [("stepwise", False)])
    for name, macro in modes:
        sim = Simulation(dataclasses.replace(topology, macro_steps=macro), costs)
        start = time.process_time()
        records = sim.run(arrivals)
        simulated = time.process_time() - start
        start = time.process_time()
        m = run_metrics(records, Slo())
        summed = time.process_time() - start
        rate = n / (simulated + summed)
        print(
            f"| {name} | {sim.events} | {simulated:.1f} | {summed:.1f} | {rate:,.0f} |"
            f" {1e6 / rate:,.0f} s |"
        )
        print(
            f"  ({m.completed}/{m.requests} ok, TTFT p50 {m.ttft.p50 or 0:.3f} s, TPOT p50"
            f" {(m.tpot.p50 or 0) * 1e3:.2f} ms, ITL p99 {(m.itl.p99 or 0) * 1e3:.2f} ms)",
            flush=True,
        )


if __name__ == "__main__":
    main()
