"""`tandem bench serve|compare`: the options, shared where the two commands share them.

`serve` and `compare` take the same workload, load, SLO and output options; `compare`
has defaults sized for a 2-core machine (a whole compare in about 15 minutes) and the
long/short prompt mix of issue 8.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from shared.model.source import DEFAULT_MODEL
from shared.runtime.options import add_option
from shared.transport.kinds import ONE_HOST_TRANSPORT, TRANSPORTS
from tandem.bench.sweep import parse_rates
from tandem.bench.workload import parse_lengths


class _BadValue(argparse.ArgumentTypeError, ValueError):
    """argparse prints its message; `add_option`'s environment parsing catches ValueError."""


def _lengths(text: str) -> Any:
    try:
        return parse_lengths(text)
    except ValueError as exc:
        raise _BadValue(str(exc)) from exc


def _rates(text: str) -> Any:
    try:
        return parse_rates(text)
    except ValueError as exc:
        raise _BadValue(f"bad request rate list {text!r}: {exc}") from exc


@dataclass(frozen=True)
class Defaults:
    output: str
    num_requests: int
    request_rate: str
    duration: float | None
    slo_ttft: float
    slo_tpot: float


SERVE = Defaults("tandem-bench-serve.json", 32, "inf", None, 2.0, 0.1)
# compare: measured on the 2-core machine, either side serves this workload at ~0.1 req/s
# (128 tokens at 0.2-0.7 s per decode step once 1,500-token contexts are in the batch), so
# the sweep brackets that: 3 rates × ≤ 80 s of arrivals (~4, 8 and 12 requests) plus each
# point's drain (its last requests' E2E, ~40-90 s) ≈ 7 min a side, ~15 min in all. The SLO
# is sized to this CPU too: a lone 1,500-token prefill takes ~5 s, and a decode step
# ~0.1-0.2 s even at small batches, so 2 s / 100 ms would be missed at any load.
COMPARE = Defaults("tandem-bench-compare.json", 16, "0.05,0.1,0.15", 80.0, 10.0, 0.25)


def add_common_options(p: argparse.ArgumentParser, d: Defaults) -> None:
    add_option(p, "--model", default=DEFAULT_MODEL, help="model name sent to the API")
    add_option(p, "--tokenizer", default=None, help="tokenizer for the prompts (default: --model)")
    add_option(p, "--api-key", default=None, help="bearer key for the API")
    add_option(
        p,
        "--prompt-len",
        type=_lengths,
        default=parse_lengths("mix:100:1500:0.2"),
        help="prompt tokens: N, uniform:A:B or mix:SHORT:LONG:FRACTION (default %(default)s)",
    )
    add_option(
        p,
        "--output-len",
        type=_lengths,
        default=parse_lengths("128"),
        help="output tokens (max_tokens), same forms as --prompt-len (default %(default)s)",
    )
    add_option(
        p,
        "--prompt-format",
        default="tokens",
        choices=["tokens", "text"],
        help="send prompts as token-id lists (exact) or as text",
    )
    add_option(
        p,
        "--no-ignore-eos",
        action="store_true",
        help="do not send ignore_eos (outputs may end early)",
    )
    add_option(p, "--num-requests", type=int, default=d.num_requests, help="per rate (%(default)s)")
    add_option(
        p,
        "--request-rate",
        type=_rates,
        default=parse_rates(d.request_rate),
        help="requests/s; a comma-separated list sweeps; inf: no pacing "
        f"(default {d.request_rate})",
    )
    add_option(p, "--arrival", default="poisson", choices=["poisson", "constant"])
    add_option(p, "--concurrency", type=int, default=None, help="cap on requests in flight")
    add_option(
        p,
        "--duration",
        type=float,
        default=d.duration,
        help="stop sending after this many seconds, per rate (%(default)s)",
    )
    add_option(p, "--warmup", type=int, default=2, help="untimed requests first")
    add_option(p, "--seed", type=int, default=0, help="workload and arrival seed")
    add_option(p, "--timeout", type=float, default=300.0, help="per request, seconds")
    add_option(p, "--slo-ttft", type=float, default=d.slo_ttft, help="TTFT target, s (%(default)s)")
    add_option(p, "--slo-tpot", type=float, default=d.slo_tpot, help="TPOT target, s (%(default)s)")
    add_option(
        p,
        "--slo-attainment",
        type=float,
        default=0.9,
        help="share of requests that must meet both targets (goodput)",
    )
    add_option(p, "--output", default=d.output, help="the JSON; PNGs are written beside it")
    add_option(p, "--quiet", action="store_true", help="no progress bar")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from tandem.bench import compare, serve

    p = sub.add_parser("bench", help="load generator and serving benchmarks")
    bench = p.add_subparsers(dest="bench_command", required=True, metavar="BENCH")

    s = bench.add_parser("serve", help="load-test one OpenAI-compatible endpoint")
    add_option(s, "--url", default="http://127.0.0.1:8000", help="server base URL")
    add_common_options(s, SERVE)
    s.set_defaults(func=serve.run)

    c = bench.add_parser(
        "compare",
        help="the same load against a colocated and a disaggregated stack on the same cores",
    )
    add_common_options(c, COMPARE)
    add_option(
        c,
        "--sides",
        default="colocated,disaggregated",
        help="which stacks to run, in order: colocated (chunked prefill), colocated-unchunked, "
        "disaggregated (a fixed 1:1 split), conditional (per-request choice)",
    )
    add_option(c, "--transport", default=ONE_HOST_TRANSPORT, choices=TRANSPORTS)
    add_option(
        c, "--profile", default=None, help="costs for the conditional side (tandem plan profile)"
    )
    add_option(
        c,
        "--colocated-url",
        default=None,
        help="measure the colocated side against this server (e.g. vLLM) instead of a stack",
    )
    add_option(c, "--colocated-model", default=None, help="model name that server serves")
    add_option(c, "--kv-cache-mb", type=int, default=1024, help="KV pool per model node")
    add_option(c, "--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    add_option(c, "--log-dir", default=None, help="the stacks' logs (default: beside --output)")
    c.set_defaults(func=compare.run)
