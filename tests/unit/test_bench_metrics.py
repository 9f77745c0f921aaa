"""`tandem bench` metrics on synthetic request timelines whose answers are known by hand."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tandem.bench.metrics import (
    RequestRecord,
    Slo,
    add_gap,
    e2e,
    goodput,
    itl_distribution,
    itls,
    meets,
    percentile,
    run_metrics,
    summarize,
    tpot,
    ttft,
    weighted_percentile,
)

pytestmark = pytest.mark.unit


def record(
    sent: float,
    chunks: list[float],
    done: float | None = None,
    tokens: int | None = None,
    error: str | None = None,
    prompt: int = 100,
) -> RequestRecord:
    return RequestRecord(
        prompt_tokens=prompt,
        max_tokens=tokens or len(chunks),
        sent=sent,
        chunks=chunks,
        done=done if done is not None else (chunks[-1] if chunks else sent),
        output_tokens=tokens if tokens is not None else len(chunks),
        error=error,
    )


def test_percentiles_interpolate_between_closest_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0]  # order must not matter
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 90) == pytest.approx(3.7)  # rank 2.7: 3 + 0.7 × (4 − 3)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile(values, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_percentiles_agree_with_numpy() -> None:
    rng = random.Random(3)
    for n in (2, 5, 37, 101):
        values = [rng.expovariate(2.0) for _ in range(n)]
        for q in (50, 90, 99):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_summary_of_known_values_and_of_nothing() -> None:
    s = summarize([1.0, 2.0, 3.0, 4.0, 5.0])
    assert (s.n, s.mean, s.p50, s.p90, s.max) == (5, 3.0, 3.0, pytest.approx(4.6), 5.0)
    empty = summarize([])
    assert empty.n == 0 and empty.mean is None and empty.p99 is None


def test_one_timeline() -> None:
    # sent at 1.0; 4 content chunks; the stream ends at 2.2
    r = record(1.0, [1.5, 1.6, 1.8, 2.1], done=2.2)
    assert ttft(r) == pytest.approx(0.5)
    assert e2e(r) == pytest.approx(1.2)
    assert tpot(r) == pytest.approx((1.2 - 0.5) / 3)
    assert itls(r) == pytest.approx([0.1, 0.2, 0.3])
    # usage can report more tokens than chunks (a chunk may carry several): TPOT uses usage
    assert tpot(record(1.0, [1.5, 2.1], done=2.2, tokens=8)) == pytest.approx(0.7 / 7)
    assert tpot(record(0.0, [0.4], done=0.5)) is None  # one token: no time per output token


def test_slo_needs_both_targets_and_success() -> None:
    slo = Slo(ttft=1.0, tpot=0.1)
    assert meets(record(0.0, [0.5, 0.6, 0.7], done=0.7), slo)  # TTFT 0.5, TPOT 0.1
    assert not meets(record(0.0, [1.5, 1.6, 1.7], done=1.7), slo)  # TTFT too long
    assert not meets(record(0.0, [0.5, 0.8, 1.1], done=1.1), slo)  # TPOT 0.3
    assert meets(record(0.0, [0.9], done=0.9), slo)  # a single token meets TPOT trivially
    assert not meets(record(0.0, [0.1, 0.2], error="HTTP 503"), slo)
    assert not meets(record(0.0, []), slo)


def test_run_metrics_on_a_small_run() -> None:
    slo = Slo(ttft=1.0, tpot=0.2)
    records = [
        # TTFT 0.5, 3 tokens, TPOT (1.5 − 0.5) / 2 = 0.5: misses TPOT
        record(0.0, [0.5, 1.0, 1.5], done=1.5, prompt=100),
        # TTFT 0.25, 5 tokens, TPOT 0.1: meets both
        record(1.0, [1.25, 1.35, 1.45, 1.55, 1.65], done=1.65, prompt=200),
        # TTFT 2.0, 2 tokens, TPOT 0.2: misses TTFT
        record(2.0, [4.0, 4.2], done=4.2, prompt=300),
        # failed after 1 s: counted in the attainment's denominator only
        record(3.0, [], done=4.0, error="HTTP 503", prompt=400),
    ]
    m = run_metrics(records, slo)
    assert (m.requests, m.completed, m.failed) == (4, 3, 1)
    assert m.duration == pytest.approx(4.2)  # first send 0.0 → last end 4.2
    assert m.request_throughput == pytest.approx(3 / 4.2)
    assert m.output_throughput == pytest.approx(10 / 4.2)
    assert m.total_token_throughput == pytest.approx((10 + 600) / 4.2)
    assert m.ttft.mean == pytest.approx((0.5 + 0.25 + 2.0) / 3)
    assert m.ttft.p50 == pytest.approx(0.5)
    assert m.tpot.p50 == pytest.approx(0.2)
    assert m.itl.n == 2 + 4 + 1
    assert m.itl.max == pytest.approx(0.5)
    assert m.e2e.p50 == pytest.approx(1.5)
    assert m.slo_attainment == pytest.approx(1 / 4)
    assert m.good_request_rate == pytest.approx(1 / 4.2)


def test_run_metrics_of_nothing_and_of_failures_only() -> None:
    m = run_metrics([], Slo())
    assert m.requests == 0 and m.request_throughput == 0 and m.slo_attainment == 0
    m = run_metrics([record(0.0, [], done=1.0, error="refused")], Slo())
    assert (m.completed, m.failed, m.ttft.n, m.slo_attainment) == (0, 1, 0, 0.0)


def test_goodput_is_the_highest_rate_meeting_the_target_with_every_lower_one() -> None:
    sweep = [(2.0, 0.80), (0.5, 1.0), (4.0, 0.2), (1.0, 0.95)]  # any order
    assert goodput(sweep, 0.9) == 1.0
    assert goodput(sweep, 0.8) == 2.0
    assert goodput(sweep, 0.1) == 4.0
    # a lucky point above a failing one is noise, not capacity
    assert goodput([(1.0, 0.95), (2.0, 0.5), (3.0, 0.92)], 0.9) == 1.0
    assert goodput([(1.0, 0.85), (2.0, 0.5)], 0.9) is None
    assert goodput([], 0.9) is None
    assert goodput([(1.0, 0.9)], 0.9) == 1.0  # the target itself counts as met


def test_goodput_from_timelines_of_a_sweep() -> None:
    """Three rates built from timelines: TTFT grows with rate until the SLO breaks."""
    slo = Slo(ttft=1.0, tpot=0.1, attainment=0.9)
    points = []
    for rate, slow in ((0.5, 0), (1.0, 1), (2.0, 5)):  # slow: requests (of 10) with TTFT 3 s
        records = [
            record(i, [i + (3.0 if i < slow else 0.5), i + (3.05 if i < slow else 0.55)])
            for i in range(10)
        ]
        points.append((rate, run_metrics(records, slo).slo_attainment))
    assert [a for _, a in points] == [1.0, 0.9, 0.5]
    assert goodput(points, slo.attainment) == 1.0


def test_gaps_kept_as_runs_summarise_as_listed_gaps() -> None:
    """A simulated record keeps its gaps as runs of equal gaps; its ITL summary (and the
    percentiles between repeated values) must be the listed gaps' exactly."""
    rng = random.Random(9)
    listed, runs = [], []
    for i in range(40):
        sent, t = float(i), float(i) + 0.5
        chunks, compact = [t], RequestRecord(100, 1, sent=sent, chunks=[t], itl_runs=[])
        for _ in range(rng.randint(1, 6)):
            gap, count = rng.choice([0.01, 0.02, 0.25]), rng.randint(1, 50)
            add_gap(compact, gap, count)
            for _ in range(count):
                chunks.append(chunks[-1] + gap)
        compact.done, compact.output_tokens = chunks[-1], len(chunks)
        listed.append(record(sent, chunks))
        runs.append(compact)
    assert [itls(r) for r in runs] == [pytest.approx(itls(r)) for r in listed]
    a, b = run_metrics(runs, Slo()).itl, run_metrics(listed, Slo()).itl
    assert a.n == b.n and a.max == pytest.approx(b.max)
    for q in ("mean", "p50", "p90", "p99"):
        assert getattr(a, q) == pytest.approx(getattr(b, q), abs=1e-9), q
    values, counts = itl_distribution(runs)
    assert values == sorted(set(values)) and sum(counts) == a.n
    assert weighted_percentile([1.0, 2.0], [3, 1], 50) == percentile([1.0, 1.0, 1.0, 2.0], 50)
    assert weighted_percentile([1.0, 2.0], [3, 1], 90) == percentile([1.0, 1.0, 1.0, 2.0], 90)
