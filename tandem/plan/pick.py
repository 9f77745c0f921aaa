"""The serving mode `tandem up` runs when no mode flag (`--colocated`, `--split`,
`--conditional`) forces one: the planner's pick for this machine, model and node counts.

1. A profile of this machine and model: the one `--profile` names, else a startup profile
   (`tandem plan profile --grid startup`: ~40 s on one core, with a progress bar) measured
   on the first start and cached under `TANDEM_CACHE/profiles/`, one file per machine,
   model, dtype, device, threads a node, data plane and Tandem version; later starts
   reuse it.
2. The planner's simulator (the router's and the scheduler's own code, with the
   profile's times) runs the node counts asked in each mode on two reference workloads:
   - steady: 16 streams at a time of 256-token prompts and 128 output tokens (the shape
     of `vllm bench serve --random-input-len 256 --random-output-len 128
     --max-concurrency 16`): output tokens/s;
   - mixed: 100- and 1,500-token prompts (one in five long), 32 output tokens, at rising
     request rates: goodput (the highest rate at which 90% of requests meet TTFT 10 s and
     TPOT 250 ms, as `tandem bench compare` judges).
   The modes, on the same cores: colocated (P + D nodes, each prefilling its own
   requests), split (P prefill + D decode nodes) and conditional (the same nodes; the
   router chooses per request where to prefill).
3. Each mode's score is the mean of its two results, each relative to the best mode's;
   the highest score wins, and a mode scoring within `TIE` of it is preferred in the
   order colocated, conditional, split (fewer processes; then no fixed route).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from shared.costs.profile import PROFILE_VERSION, read_profile
from shared.model.convert import cache_root
from tandem import __version__
from tandem.bench.metrics import goodput

Mode = Literal["colocated", "split", "conditional"]
MODES: tuple[Mode, ...] = ("colocated", "conditional", "split")  # the order ties go in
TIE = 0.02  # scores this close count as equal: the simulator is not that exact
PROFILE_TIMEOUT = 600.0  # seconds for the startup profile (it takes ~40 s on one core)

# The reference workloads, as `tandem plan simulate` options.
STEADY = ["--prompt-len", "256", "--output-len", "128", "--num-requests", "48",
          "--concurrency", "16", "--request-rate", "inf"]  # fmt: skip
MIXED_RATES = [round(0.1 * 2 ** (k / 4), 3) for k in range(28)]  # 0.1 ... 12 req/s
MIXED = ["--prompt-len", "mix:100:1500:0.2", "--output-len", "32", "--num-requests", "30",
         "--request-rate", ",".join(map(str, MIXED_RATES)),
         "--slo-ttft", "10", "--slo-tpot", "0.25", "--slo-attainment", "0.9"]  # fmt: skip


@dataclass(frozen=True)
class Choice:
    """The mode picked, each mode's score (1.0: the best on both workloads) and results."""

    mode: Mode
    scores: dict[Mode, float]
    steady_tok_s: dict[Mode, float]
    mixed_goodput: dict[Mode, float]

    def reason(self) -> str:
        """What was compared, in a few words and figures."""

        def each(results: dict[Mode, float], unit: str) -> str:
            return " / ".join(f"{m} {results[m]:.3g}" for m in MODES) + f" {unit}"

        return (
            f"simulated from this machine's profile: 16 steady streams "
            f"{each(self.steady_tok_s, 'tok/s')}; mixed prompts, goodput "
            f"{each(self.mixed_goodput, 'req/s')}"
        )


@dataclass(frozen=True)
class Setting:
    """What a startup profile depends on (its cache key) and how the stack will run."""

    model: str
    dtype: str
    device: str
    threads: int  # torch threads a node
    transport: str

    def key(self) -> str:
        from tandem.plan.profile import cpu_flags, cpu_name

        source = Path(self.model).expanduser()
        stamp = source.stat().st_mtime_ns if source.exists() else 0
        facts = {
            "model": self.model,
            "model_mtime": stamp,
            "dtype": self.dtype,
            "device": self.device,
            "threads": self.threads,
            "transport": self.transport,
            "cpu": cpu_name(),
            "flags": cpu_flags(),
            "cores": len(os.sched_getaffinity(0)),
            "profile_version": PROFILE_VERSION,
            "tandem": __version__,
        }
        return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]

    def cached_profile(self) -> Path:
        return cache_root() / "profiles" / f"startup-{self.key()}.json"


def ensure_profile(setting: Setting, say: Callable[[str], None]) -> Path:
    """The cached startup profile for `setting`, measured first if there is none."""
    path = setting.cached_profile()
    if path.exists():
        try:
            read_profile(str(path))
            return path
        except ValueError:  # unreadable or from another version: measured again
            path.unlink(missing_ok=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    say(
        "[up] measuring this machine and model to pick the serving mode (first start only, "
        f"~40 s; cached as {path})"
    )
    partial = path.with_suffix(".partial")
    argv = [
        sys.executable, "-m", "tandem.main", "plan", "profile", "--grid", "startup",
        "--model", setting.model, "--dtype", setting.dtype, "--device", setting.device,
        "--threads", str(setting.threads), "--transport", setting.transport,
        "--output", str(partial),
    ]  # fmt: skip
    try:
        done = subprocess.run(argv, stdout=subprocess.DEVNULL, timeout=PROFILE_TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"the startup profile took over {PROFILE_TIMEOUT:g} s") from exc
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"the startup profile failed (exit {done.returncode})")
    partial.replace(path)  # whole or not at all: a stopped start leaves no half profile
    return path


def choose(profile: str, prefill: int, decode: int, node_options: list[str]) -> Choice:
    """Rank the three modes for `prefill` + `decode` nodes on the reference workloads.
    `node_options` are `tandem plan simulate` options the stack's nodes run with (step
    budget, transport, TPOT target, ...)."""
    from tandem.plan import simulate

    parser = argparse.ArgumentParser(prog="tandem plan")  # simulate's own options, no CLI
    simulate.add_parser(parser.add_subparsers(dest="command"))

    def run(mode: Mode, workload: list[str]) -> tuple[float, float]:
        nodes = (
            ["--colocated", str(prefill + decode)]
            if mode == "colocated"
            else ["--prefill", str(prefill), "--decode", str(decode)]
        )
        if mode == "conditional":
            nodes.append("--conditional")
        argv = ["simulate", "--profile", profile, "--quiet", *nodes]
        args = parser.parse_args([*argv, *node_options, *workload])
        sweep = simulate.simulate(args)
        points = [(p.rate or 0.0, p.metrics.slo_attainment) for p in sweep.points]
        tok_s = max(p.metrics.output_throughput for p in sweep.points)
        return tok_s, goodput(points, args.slo_attainment) or 0.0

    steady = {m: run(m, STEADY)[0] for m in MODES}
    mixed = {m: run(m, MIXED)[1] for m in MODES}
    scores = {m: (_share(steady, m) + _share(mixed, m)) / 2 for m in MODES}
    return Choice(best(scores), scores, steady, mixed)


def best(scores: dict[Mode, float]) -> Mode:
    """The highest score's mode; of modes within `TIE` of it, the first in `MODES`."""
    top = max(scores.values())
    return next(m for m in MODES if scores[m] >= top - TIE)


def _share(results: dict[Mode, float], mode: Mode) -> float:
    best = max(results.values())
    return results[mode] / best if best > 0 else 1.0
