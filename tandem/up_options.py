"""`tandem up`'s options: the stack's nodes, mode, placement, planes and autoscaling.

Apart from the command (tandem/up.py), so that what starts a stack for a benchmark
(`tandem bench compare`) builds the same options without importing the command, whose mode
choice imports the planner, which imports the benchmarks.
"""

from __future__ import annotations

import argparse

from shared.procs import BACKGROUND_NICE
from shared.runtime.options import (
    add_chunking_options,
    add_engine_choice,
    add_model_options,
    add_nats_auth_options,
    add_open_api_option,
    add_option,
    niceness,
    target_seconds,
    thread_count,
)
from shared.transport.kinds import ONE_HOST_TRANSPORT, TRANSPORTS
from tandem.autoscale.options import add_metrics_options, add_policy_options


def add_up_options(p: argparse.ArgumentParser) -> None:
    add_engine_choice(p)
    add_option(
        p, "--prefill", type=int, default=None, help="prefill nodes (default 1; 0: colocated)"
    )
    add_option(
        p,
        "--colocated",
        action="store_true",
        help="force colocated serving: no prefill node, each decode node prefills its own "
        "requests (default: the mode the planner ranks best for this machine)",
    )
    add_option(
        p,
        "--split",
        action="store_true",
        help="force the fixed split: every prompt prefilled on the prefill nodes",
    )
    add_option(
        p,
        "--conditional",
        action="store_true",
        help="force conditional disaggregation: the router prefills each request on its "
        "decode node or on the prefill nodes, whichever gives the first token sooner",
    )
    add_option(
        p,
        "--profile",
        default=None,
        help="this machine's costs (a tandem plan profile JSON) for the mode choice and "
        "--conditional (default: a startup profile measured once and cached)",
    )
    add_option(
        p,
        "--tpot-target",
        type=target_seconds,
        default=0.0,
        help="seconds a token the running streams keep within: --conditional (with --profile) "
        "prefills on a decode node only while they do (0: no target)",
    )
    add_option(p, "--pin-cores", action="store_true", help="pin each model node to its own core")
    add_option(
        p,
        "--isolate-decode",
        action="store_true",
        help="each decode node's engine thread on a core nothing else uses; every other "
        "process and thread on the remaining cores (needs more cores than decode nodes)",
    )
    add_option(
        p,
        "--background-nice",
        type=niceness,
        default=BACKGROUND_NICE,
        help="niceness of the prefill and kvcache nodes (0-19; 0: as the rest), so that where "
        "they share cores with decode nodes the decode steps, which every stream waits on, "
        "run first (docs/benchmarks-log.md)",
    )
    add_option(
        p,
        "--no-core-lending",
        action="store_true",
        help="keep each node on its share of the cores; by default one decode node beside "
        "prefill nodes on shared cores steps on every core while they are idle",
    )
    add_option(
        p,
        "--prefill-idle-threads",
        type=thread_count,
        default=None,
        help="torch threads of a prefill node for a batch the router sent while serving "
        "nothing else, so with every decode node idle (default: every core, unless "
        "--isolate-decode or --pin-cores keeps nodes apart; 0: never more than --threads)",
    )
    add_option(p, "--decode", type=int, default=1, help="decode nodes (of each model)")
    add_option(
        p,
        "--shared-decode",
        action="store_true",
        help="several models: each of the --decode nodes hosts every model, their KV memory "
        "one --kv-cache-mb budget (instead of --decode nodes per model)",
    )
    add_option(p, "--kvcache", type=int, default=1, help="KV-cache nodes")
    add_option(p, "--kvcache-mb", type=int, default=1024, help="memory per KV-cache node")
    add_option(p, "--host", default="127.0.0.1")
    add_option(p, "--port", type=int, default=8000)
    add_option(p, "--nats", default=None, help="use this NATS server instead of starting one")
    add_option(p, "--nats-port", type=int, default=None, help="port of the embedded nats-server")
    add_nats_auth_options(p)
    add_option(p, "--api-keys", default=None, help="comma-separated bearer keys for the API")
    add_option(p, "--api-keys-file", default=None, help="file of bearer keys, one per line")
    add_open_api_option(p)
    add_option(p, "--transport", default=ONE_HOST_TRANSPORT, choices=TRANSPORTS)
    add_option(p, "--kv-cache-mb", type=int, default=1024)
    add_chunking_options(p, deployment=True)  # the model nodes' (and the router's choice)
    add_option(p, "--heartbeat-ttl", type=float, default=6.0)
    add_option(p, "--log-level", default="INFO")
    add_option(p, "--otlp-endpoint", default=None, help="export traces over OTLP (e.g. Jaeger)")
    add_option(
        p,
        "--prometheus-targets",
        default=None,
        help="keep this Prometheus file_sd JSON file listing every process's /metrics while "
        "the stack runs (deploy/observability/compose.yaml reads it)",
    )
    add_option(
        p,
        "--autoscale",
        action="store_true",
        help="scale prefill and decode nodes with load (see the --decode-max ... options)",
    )
    add_model_options(p, several=True)  # each model gets --prefill and --decode nodes
    add_policy_options(p)
    add_metrics_options(p)


def keys_given(args: argparse.Namespace) -> bool:
    """Whether the stack's router gets API keys (`--api-keys` or `--api-keys-file`, each
    also read from TANDEM_*): an open API or not."""
    return bool(args.api_keys or args.api_keys_file)


def up_parser() -> argparse.ArgumentParser:
    """A parser of `tandem up`'s options alone (its first argument: `up`)."""
    parser = argparse.ArgumentParser(prog="tandem")
    sub = parser.add_subparsers(dest="command")
    add_up_options(sub.add_parser("up"))
    return parser
