"""Benchmark output: the JSON document, a markdown table, and PNG plots (matplotlib, Agg).

One or more sweeps (a label each: one server, or the two sides of a comparison) go into
each output, so `serve` and `compare` share all of it. Plots sit next to the JSON:
`<stem>-latency-cdf.png` (TTFT, TPOT, ITL, E2E distributions per rate) and
`<stem>-sweep.png` (throughput, SLO attainment and good requests/s against the offered
rate; only for paced points).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tandem.bench.metrics import RequestRecord, e2e, itl_distribution, tpot, ttft
from tandem.bench.sweep import Sweep, rate_label


def record_json(r: RequestRecord) -> dict[str, Any]:
    return {
        "prompt_tokens": r.prompt_tokens,
        "max_tokens": r.max_tokens,
        "output_tokens": r.output_tokens,
        "sent": round(r.sent, 6),
        "ttft": round(ttft(r), 6) if r.chunks else None,
        "tpot": round(t, 6) if r.ok and (t := tpot(r)) is not None else None,
        "e2e": round(e2e(r), 6),
        "error": r.error,
        "chunk_offsets": [round(c - r.sent, 5) for c in r.chunks],  # CDFs can be redrawn
        **({} if r.itl_runs is None else {"itl_runs": [[round(g, 6), n] for g, n in r.itl_runs]}),
    }


def sweep_json(sweep: Sweep) -> dict[str, Any]:
    return {
        "label": sweep.label,
        "slo": asdict(sweep.slo),
        "goodput": sweep.goodput,
        "points": [
            {
                "request_rate": p.rate,  # null: unpaced
                "concurrency": p.concurrency,
                "metrics": asdict(p.metrics),
                **({} if p.routes is None else {"routes": p.routes}),
                "requests": [record_json(r) for r in p.records],
            }
            for p in sweep.points
        ],
    }


def write_json(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")


def _f(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def table(sweeps: list[Sweep]) -> str:
    """Markdown: one row per (sweep, rate); goodput per sweep below. Times in seconds, TPOT
    and ITL in ms."""
    head = (
        "| side | rate req/s | ok | req/s | out tok/s | TTFT p50 | TTFT p99 | TPOT p50 ms | "
        "TPOT p99 ms | ITL p99 ms | E2E p50 | SLO met | good req/s |"
    )
    rows = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    rates = sorted({p.rate for s in sweeps for p in s.points}, key=lambda r: r or float("inf"))
    for rate in rates:  # rate-major, so the sides of a comparison sit next to each other
        for s in sweeps:
            for p in (p for p in s.points if p.rate == rate):
                m = p.metrics
                rows.append(
                    f"| {s.label} | {rate_label(rate)} | {m.completed}/{m.requests} | "
                    f"{m.request_throughput:.2f} | {m.output_throughput:.1f} | "
                    f"{_f(m.ttft.p50)} | {_f(m.ttft.p99)} | {_f(m.tpot.p50, 1e3, 0)} | "
                    f"{_f(m.tpot.p99, 1e3, 0)} | {_f(m.itl.p99, 1e3, 0)} | {_f(m.e2e.p50)} | "
                    f"{m.slo_attainment:.0%} | {m.good_request_rate:.2f} |"
                )
    for s in sweeps:
        slo = s.slo
        rows.append("")
        rows.append(
            f"{s.label}: goodput {_f(s.goodput, 1.0, 3) if s.goodput else 'none'} req/s "
            f"(≥{slo.attainment:.0%} of requests with TTFT ≤ {slo.ttft:g} s and "
            f"TPOT ≤ {slo.tpot * 1e3:g} ms)"
        )
    return "\n".join(rows)


def png_paths(json_path: Path) -> tuple[Path, Path]:
    stem = json_path.with_suffix("")
    return Path(f"{stem}-latency-cdf.png"), Path(f"{stem}-sweep.png")


def plot(sweeps: list[Sweep], json_path: Path) -> list[Path]:
    """Write the PNGs; the paths written."""
    from matplotlib.figure import Figure  # no pyplot: no global state, Agg canvas by default

    cdf_path, sweep_path = png_paths(json_path)
    fig = Figure(figsize=(11, 8), layout="constrained")
    axes = fig.subplots(2, 2)
    metrics = [
        ("TTFT (s)", lambda r: [ttft(r)]),
        ("TPOT (ms)", lambda r: [t * 1e3] if (t := tpot(r)) is not None else []),
        ("ITL (ms)", None),
        ("E2E latency (s)", lambda r: [e2e(r)]),
    ]
    styles = ["-", "--", ":", "-."]
    for ax, (name, values_of) in zip(axes.flat, metrics, strict=True):
        for k, s in enumerate(sweeps):
            for j, p in enumerate(s.points):
                done = [r for r in p.records if r.ok]
                if values_of is None:  # gaps: counted by value (a simulation's are many)
                    values, counts = itl_distribution(done)
                    values = [v * 1e3 for v in values]
                else:
                    values = sorted(v for r in done for v in values_of(r))
                    counts = [1] * len(values)
                if not values:
                    continue
                total = sum(counts)
                ys = [c / total for c in itertools.accumulate(counts)]
                ax.step(values, ys, where="post", color=f"C{j}", linestyle=styles[k % 4],
                        label=f"{s.label} @ {rate_label(p.rate)} req/s")  # fmt: skip
        ax.set_xlabel(name)
        ax.set_ylabel("share of requests" if "ITL" not in name else "share of gaps")
        if "ITL" in name:  # gaps span ms (steady decode) to seconds (a prefill in the way)
            ax.set_xscale("log", nonpositive="clip")
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize="small")
    fig.suptitle("Latency distributions (CDF)")
    fig.savefig(cdf_path, dpi=110)
    written = [cdf_path]
    paced = [s for s in sweeps if any(p.rate is not None for p in s.points)]
    if paced:
        fig = Figure(figsize=(11, 8), layout="constrained")
        axes = fig.subplots(2, 2)
        panels = [
            ("completed requests/s", lambda m: m.request_throughput),
            ("output tokens/s", lambda m: m.output_throughput),
            ("SLO attainment", lambda m: m.slo_attainment),
            ("good requests/s (meeting the SLO)", lambda m: m.good_request_rate),
        ]
        for ax, (name, value_of) in zip(axes.flat, panels, strict=True):
            for k, s in enumerate(paced):
                pts = sorted((p.rate, value_of(p.metrics)) for p in s.points if p.rate)
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o",
                        linestyle=styles[k % 4], color=f"C{k}", label=s.label)  # fmt: skip
            ax.set_xlabel("offered request rate (req/s)")
            ax.set_ylabel(name)
            ax.grid(alpha=0.3)
        target = paced[0].slo.attainment
        axes[1, 0].axhline(target, color="grey", linestyle=":", label=f"target {target:.0%}")
        axes[1, 0].set_ylim(-0.02, 1.02)
        axes[0, 0].legend(fontsize="small")
        axes[1, 0].legend(fontsize="small")
        slo = paced[0].slo
        fig.suptitle(f"Throughput and SLO (TTFT ≤ {slo.ttft:g} s, TPOT ≤ {slo.tpot * 1e3:g} ms)")
        fig.savefig(sweep_path, dpi=110)
        written.append(sweep_path)
    return written
