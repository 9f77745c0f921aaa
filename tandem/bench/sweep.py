"""A benchmark run: warm up, then one load point per request rate, each measured on its own.

Every point gets fresh prompts (a seed per point), so no point finds the previous one's
prompts in a prefix cache; the same seed gives the same requests in every run, so two
servers compared with one seed see identical workloads.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.errors import TandemError
from tandem.bench.loadgen import Load, Progress, Target, run_load
from tandem.bench.metrics import RequestRecord, RunMetrics, Slo, goodput, run_metrics
from tandem.bench.workload import Workload


class BenchError(TandemError):
    """The benchmark cannot run (e.g. the server answers no warm-up request)."""


@dataclass(frozen=True)
class SweepConfig:
    rates: list[float | None]  # one point per rate; None: unpaced (closed loop)
    num_requests: int = 32
    arrival: str = "poisson"
    concurrency: int | None = None
    duration: float | None = None  # per point
    warmup: int = 2
    seed: int = 0
    quiet: bool = False  # no progress bar


@dataclass
class Point:
    rate: float | None
    concurrency: int | None
    metrics: RunMetrics
    records: list[RequestRecord]
    # the server's requests by route during the point (local / remote prefill), when read
    routes: dict[str, int] | None = None


@dataclass
class Sweep:
    label: str
    slo: Slo
    points: list[Point] = field(default_factory=list)

    @property
    def goodput(self) -> float | None:
        paced = [(p.rate, p.metrics.slo_attainment) for p in self.points if p.rate is not None]
        return goodput(paced, self.slo.attainment) if paced else None


def parse_rates(text: str) -> list[float | None]:
    """argparse `type=`: "0.5,1,2" → a sweep; "inf" sends without pacing."""
    rates: list[float | None] = []
    for part in text.split(","):
        value = float(part)
        if value <= 0 or math.isnan(value):
            raise ValueError(f"request rate {part!r} must be positive (or inf)")
        rates.append(None if math.isinf(value) else value)
    return rates


def rate_label(rate: float | None) -> str:
    return "inf" if rate is None else f"{rate:g}"


WARMUP_MAX_TOKENS = 16  # enough decode steps to warm that path; more would only cost time


async def warm_up(target: Target, workload: Workload, cfg: SweepConfig) -> None:
    """Untimed requests first: lazy allocations, caches and connections settle."""
    if cfg.warmup <= 0:
        return
    specs = workload.requests(cfg.warmup, seed=f"{cfg.seed}/warmup")
    for spec in specs:
        spec.max_tokens = min(spec.max_tokens, WARMUP_MAX_TOKENS)
    records = await run_load(target, specs, Load(rate=None))
    failures = [r.error for r in records if r.error is not None]
    if len(failures) == len(records):
        raise BenchError(f"every warm-up request failed; the first: {failures[0]}")


async def run_sweep(
    target: Target,
    workload: Workload,
    cfg: SweepConfig,
    slo: Slo,
    label: str,
    say: Callable[[str], None] = print,
    routes: Callable[[], dict[str, int]] | None = None,
) -> Sweep:
    """`routes`, if given, reads the server's requests by route so far: each point keeps
    what it added (which requests the server prefilled where, to explain the point)."""
    sweep = Sweep(label, slo)
    say(f"[{label}] warm-up: {cfg.warmup} request(s)")
    await warm_up(target, workload, cfg)
    for i, rate in enumerate(cfg.rates):
        specs = workload.requests(cfg.num_requests, seed=f"{cfg.seed}/point-{i}")
        progress = Progress(len(specs), f"{label} rate {rate_label(rate)}", cfg.quiet)
        load = Load(rate, cfg.arrival, cfg.concurrency, cfg.duration)
        before = await asyncio.to_thread(routes) if routes else {}
        try:
            records = await run_load(target, specs, load, seed=cfg.seed + i, on_done=progress.done)
        finally:
            progress.close()
        m = run_metrics(records, slo)
        point = Point(rate, cfg.concurrency, m, records)
        if routes:
            after = await asyncio.to_thread(routes)
            point.routes = {
                k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)
            }
        sweep.points.append(point)
        say(
            f"[{label}] rate {rate_label(rate)}: {m.completed}/{m.requests} ok, "
            f"{m.request_throughput:.2f} req/s, {m.output_throughput:.1f} tok/s, "
            f"TTFT p50 {_s(m.ttft.p50)}, TPOT p50 {_s(m.tpot.p50)}, "
            f"SLO {m.slo_attainment:.0%}"
            + ("" if point.routes is None else f", routes {point.routes}")
        )
    return sweep


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"
