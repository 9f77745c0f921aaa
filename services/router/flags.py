"""The router command's options beyond a node's own: request limits and API keys, deadlines
and liveness, and how requests are routed (`tandem router --help` lists them)."""

from __future__ import annotations

import argparse

from services.router.config import RouterConfig
from services.router.validation import Limits
from shared.runtime.options import (
    add_chunking_options,
    add_open_api_option,
    add_option,
    target_seconds,
)

# One table of defaults: the settings' own (config.py, validation.py), read by `--help`.
CONFIG, LIMITS = RouterConfig(), Limits()


def add_limit_options(p: argparse.ArgumentParser) -> None:
    """What one request and all of them together may ask; API keys."""
    add_option(
        p,
        "--max-inflight",
        type=int,
        default=CONFIG.max_inflight,
        help="admitted requests; then 429",
    )
    add_option(p, "--max-body-bytes", type=int, default=CONFIG.max_body_bytes)
    add_option(
        p,
        "--body-timeout",
        type=float,
        default=CONFIG.body_timeout,
        help="seconds a request's body may take to arrive once its headers did (then 408); "
        "a request counts against --max-inflight only once its body is in",
    )
    add_option(
        p,
        "--idle-timeout",
        type=float,
        default=10.0,
        help="seconds a connection may stay without a whole request's headers: from when it "
        "opens, and from each response on (a slow or silent client holds no socket longer)",
    )
    add_option(p, "--max-tokens-limit", type=int, default=LIMITS.max_tokens)
    add_option(p, "--max-prompt-tokens", type=int, default=None, help="default: model context")
    add_option(p, "--max-stop", type=int, default=LIMITS.max_stop, help="stop strings per request")
    add_option(
        p,
        "--max-stop-len",
        type=int,
        default=LIMITS.max_stop_len,
        help="characters per stop string",
    )
    add_option(p, "--api-keys", default=None, help="comma-separated bearer keys (none: open API)")
    add_option(p, "--api-keys-file", default=None, help="file of bearer keys, one per line")
    add_option(p, "--max-inflight-per-key", type=int, default=64, help="then 429 for that key")
    add_option(
        p,
        "--metrics-auth",
        action="store_true",
        help="serve /metrics on the API port to any API key (tenants then read the route "
        "counters, prefix-cache hits among them; --metrics-port keeps them to operators)",
    )
    add_option(
        p,
        "--metrics-port",
        type=int,
        default=None,
        help="serve /metrics on this port too (0: any free one); with API keys configured "
        "and no --metrics-auth, the only place it is served",
    )
    add_option(
        p,
        "--metrics-host",
        default="127.0.0.1",
        help="address --metrics-port listens on (a pod IP or 0.0.0.0 for a Prometheus "
        "elsewhere; keep it where only operators reach it)",
    )
    add_open_api_option(p)


def add_failure_options(p: argparse.ArgumentParser) -> None:
    """Deadlines, liveness probes, the registry entry and the resume lease."""
    add_option(p, "--first-token-timeout", type=float, default=CONFIG.first_token_timeout)
    add_option(p, "--stall-timeout", type=float, default=CONFIG.stall_timeout)
    add_option(
        p,
        "--probe-after",
        type=float,
        default=0.5,
        help="ping the node a stream waits on after this long without a token (0: never)",
    )
    add_option(
        p,
        "--request-timeout",
        type=float,
        default=CONFIG.request_timeout,
        help="deadline of a whole request",
    )
    add_option(
        p,
        "--heartbeat-ttl",
        type=float,
        default=3.0,
        help="this router's registry entry lapses this long after its last heartbeat",
    )
    add_option(
        p,
        "--resume-lease",
        type=float,
        default=5.0,
        help="seconds a client of a dead router has to resume its stream; then the request "
        "is cancelled and its KV blocks freed",
    )


def add_routing_options(p: argparse.ArgumentParser) -> None:
    """Where requests go: local prefill, standbys, colocated."""
    add_option(
        p,
        "--local-prefill-max-tokens",
        type=int,
        default=96,
        help="send a request to the decode node caching its prefix when at most this many "
        "prompt tokens are uncached there (0: always disaggregate)",
    )
    add_option(
        p,
        "--standby-after",
        type=int,
        default=CONFIG.standby_after,
        help="delivered tokens after which another decode node loads a stream's stored KV, "
        "so that a failover there loads only what was stored since (0: no standby)",
    )
    add_option(
        p,
        "--colocated",
        action="store_true",
        help="no prefill nodes: every request is prefilled on a decode node (the baseline)",
    )
    add_option(
        p,
        "--conditional",
        action="store_true",
        help="per request, prefill on the decode node or on the prefill pool, whichever the "
        "costs say gives the first token sooner (see --profile)",
    )
    add_option(
        p,
        "--profile",
        default=None,
        help="a `tandem plan profile` JSON the conditional choice takes its costs from "
        "(without one: a fixed rule on the prefill pool's backlog)",
    )
    add_option(
        p,
        "--tpot-target",
        type=target_seconds,
        default=0.0,
        help="seconds a token: the conditional choice (with --profile) prefills on a decode "
        "node only while its running streams keep within this (0: no target)",
    )
    add_option(
        p,
        "--cache-isolation",
        choices=["auto", "shared", "key"],
        default="auto",
        help="shared: prefix caching across API keys (fastest; time to first token can tell "
        "a client whether another sent a prefix); key: each key's cached blocks its own; "
        "auto (default): key when API keys are configured, shared when the API is open",
    )
    add_chunking_options(p)  # the decode nodes' own: the conditional choice models them
