"""Serving metrics as pure functions of per-request timelines (seconds on one clock).

Definitions (also in docs/benchmarks-log.md):
- TTFT: first content chunk − send.
- TPOT: (E2E − TTFT) / (output tokens − 1); undefined for a one-token answer.
- ITL: the gaps between consecutive content chunks.
- E2E: end of the response − send.
- SLO attainment: the share of all requests sent (failures count as misses) whose TTFT and
  TPOT both meet their targets; a request with no TPOT meets that target trivially.
- Goodput: the highest swept request rate at which attainment ≥ the target share, every
  lower swept rate included (one lucky point above a failing one is noise, not capacity).
Percentiles interpolate linearly between closest ranks (numpy's default), so small
samples give the numbers other tools print too.

A simulated hour of a cluster delivers too many tokens to list each one's arrival, so a
record may keep its gaps as runs of equal gaps instead (`itl_runs`); every metric reads
both forms alike (`itl_distribution`).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.runtime.collector import collector_paused


@dataclass
class RequestRecord:
    """One request's timeline. The client fills it in; it never raises, it records."""

    prompt_tokens: int
    max_tokens: int
    sent: float = 0.0
    chunks: list[float] = field(default_factory=list)  # arrival of each content chunk
    # The gaps after the first chunk as runs [gap seconds, how many], instead of chunks[1:]
    # (None: `chunks` lists every arrival). `tandem plan simulate` records this way.
    itl_runs: list[list[float]] | None = None
    done: float = 0.0  # the stream ended ([DONE], or the error)
    output_tokens: int = 0  # usage.completion_tokens when reported, else len(chunks)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunks)


@dataclass(frozen=True)
class Slo:
    ttft: float = 2.0  # seconds
    tpot: float = 0.1  # seconds per output token
    attainment: float = 0.9  # share of requests that must meet both, for goodput


@dataclass
class Summary:
    n: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None


@dataclass
class RunMetrics:
    requests: int
    completed: int
    failed: int
    duration: float  # first send → last response end
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens of completed requests / s
    total_token_throughput: float  # prompt + output tokens of completed requests / s
    ttft: Summary
    tpot: Summary
    itl: Summary
    e2e: Summary
    slo_attainment: float
    good_request_rate: float  # requests meeting the SLO / s


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear between closest ranks."""
    return _ranked(sorted(values), q)


def _ranked(ordered: Sequence[float], q: float) -> float:
    """`percentile` of values already in ascending order."""
    if not ordered:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside 0-100")
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(values: Sequence[float]) -> Summary:
    if not values:
        return Summary(0, None, None, None, None, None)
    ordered = sorted(values)  # once for every percentile (a simulated hour has ~1M values)
    return Summary(
        n=len(values),
        mean=sum(values) / len(values),
        p50=_ranked(ordered, 50),
        p90=_ranked(ordered, 90),
        p99=_ranked(ordered, 99),
        max=ordered[-1],
    )


def weighted_percentile(values: Sequence[float], counts: Sequence[int], q: float) -> float:
    """`percentile` of the list holding each of `values` (ascending) `counts` times,
    without making that list."""
    total = sum(counts)
    if not total:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside 0-100")
    pos = (total - 1) * q / 100
    lo = math.floor(pos)
    cumulative = list(itertools.accumulate(counts))
    i = bisect.bisect_right(cumulative, lo)  # the value at rank lo (0-based)
    j = bisect.bisect_right(cumulative, min(lo + 1, total - 1))
    return values[i] + (values[j] - values[i]) * (pos - lo)


def summarize_counted(values: Sequence[float], counts: Sequence[int]) -> Summary:
    """`summarize` of each of `values` (ascending, distinct) repeated `counts` times."""
    total = sum(counts)
    if not total:
        return Summary(0, None, None, None, None, None)
    return Summary(
        n=total,
        mean=sum(v * c for v, c in zip(values, counts, strict=True)) / total,
        p50=weighted_percentile(values, counts, 50),
        p90=weighted_percentile(values, counts, 90),
        p99=weighted_percentile(values, counts, 99),
        max=values[-1],
    )


def ttft(r: RequestRecord) -> float:
    return r.chunks[0] - r.sent


def e2e(r: RequestRecord) -> float:
    return r.done - r.sent


def tpot(r: RequestRecord) -> float | None:
    if r.output_tokens < 2:
        return None
    return (e2e(r) - ttft(r)) / (r.output_tokens - 1)


def itls(r: RequestRecord) -> list[float]:
    if r.itl_runs is not None:
        return [gap for gap, count in r.itl_runs for _ in range(int(count))]
    return [b - a for a, b in zip(r.chunks, r.chunks[1:], strict=False)]


def add_gap(r: RequestRecord, gap: float, count: int = 1) -> None:
    """`count` more gaps of `gap` seconds in a record kept as runs (`itl_runs`)."""
    runs = r.itl_runs if r.itl_runs is not None else []
    r.itl_runs = runs
    if runs and runs[-1][0] == gap:
        runs[-1][1] += count
    else:
        runs.append([gap, count])


def itl_distribution(records: Sequence[RequestRecord]) -> tuple[list[float], list[int]]:
    """Every gap of these records: the distinct values ascending, and how often each."""
    counts: dict[float, int] = {}
    for r in records:
        if r.itl_runs is not None:
            for gap, count in r.itl_runs:
                counts[gap] = counts.get(gap, 0) + int(count)
        else:
            for gap in itls(r):
                counts[gap] = counts.get(gap, 0) + 1
    values = sorted(counts)
    return values, [counts[v] for v in values]


def meets_ttft(r: RequestRecord, slo: Slo) -> bool:
    """A completed request's first token came within the TTFT target."""
    return ttft(r) <= slo.ttft


def meets_tpot(r: RequestRecord, slo: Slo) -> bool:
    """A completed request's tokens came within the TPOT target (trivially with one token)."""
    per_token = tpot(r)
    return per_token is None or per_token <= slo.tpot


def meets(r: RequestRecord, slo: Slo) -> bool:
    return r.ok and meets_ttft(r, slo) and meets_tpot(r, slo)


def run_metrics(records: Sequence[RequestRecord], slo: Slo) -> RunMetrics:
    with collector_paused():  # a simulated hour's million records: lists, no cycles
        return _run_metrics(records, slo)


def _run_metrics(records: Sequence[RequestRecord], slo: Slo) -> RunMetrics:
    done = [r for r in records if r.ok]
    duration = max(r.done for r in records) - min(r.sent for r in records) if records else 0.0
    per_s = 1 / duration if duration > 0 else 0.0
    output = sum(r.output_tokens for r in done)
    good = sum(1 for r in records if meets(r, slo))
    return RunMetrics(
        requests=len(records),
        completed=len(done),
        failed=len(records) - len(done),
        duration=duration,
        request_throughput=len(done) * per_s,
        output_throughput=output * per_s,
        total_token_throughput=(output + sum(r.prompt_tokens for r in done)) * per_s,
        ttft=summarize([ttft(r) for r in done]),
        tpot=summarize([t for r in done if (t := tpot(r)) is not None]),
        itl=summarize_counted(*itl_distribution(done)),
        e2e=summarize([e2e(r) for r in done]),
        slo_attainment=good / len(records) if records else 0.0,
        good_request_rate=good * per_s,
    )


def goodput(points: Sequence[tuple[float, float]], target: float) -> float | None:
    """Highest rate whose attainment, and that of every lower rate, is ≥ target.

    `points` are (request rate, SLO attainment) pairs from a sweep, in any order; None when
    even the lowest rate misses the target.
    """
    best = None
    for rate, attainment in sorted(points):
        if attainment < target:
            break
        best = rate
    return best
