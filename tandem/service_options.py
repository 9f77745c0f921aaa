"""Options shared by the service commands (`tandem router|prefill|decode|kvcache`)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from shared.engine.engine import Engine, EngineConfig
from shared.errors import Stopped, TandemError
from shared.tasks import cancel_and_wait
from tandem.options import add_model_options, add_option


def add_nats_auth_options(p: argparse.ArgumentParser) -> None:
    """Credentials for NATS; pass secrets by environment, not flags (`ps` shows flags)."""
    add_option(p, "--nats-user", default=None, help="NATS user name")
    add_option(p, "--nats-password", default=None, help="NATS password")
    add_option(p, "--nats-creds", default=None, help="NATS NKEY/JWT credentials file")
    add_option(p, "--nats-tls-ca", default=None, help="CA file: connect to NATS over TLS")


def add_node_options(
    p: argparse.ArgumentParser, model: bool = True, metrics_port: bool = True
) -> None:
    add_option(p, "--nats", default="nats://127.0.0.1:4222", help="NATS server URL")
    add_nats_auth_options(p)
    add_option(p, "--node-id", default=None, help="unique node name (default: role-host-random)")
    add_option(p, "--log-level", default="INFO")
    if metrics_port:  # the router serves /metrics on its API port instead
        add_option(p, "--metrics-port", type=int, default=None, help="serve /metrics (0: any port)")
        add_option(
            p,
            "--metrics-host",
            default="127.0.0.1",
            help="address /metrics listens on (0.0.0.0 for a Prometheus elsewhere)",
        )
    if model:
        add_model_options(p)


def add_data_plane_options(p: argparse.ArgumentParser) -> None:
    add_option(p, "--transport", default="tcp", choices=["ucx", "tcp"], help="KV data plane")
    add_option(
        p,
        "--data-host",
        default="127.0.0.1",
        help="address peers reach this node at (auto: this host's address)",
    )
    add_option(p, "--data-port", type=int, default=0, help="data-plane port (0: any free)")


def add_engine_options(p: argparse.ArgumentParser) -> None:
    add_option(p, "--kv-cache-mb", type=int, default=1024, help="KV cache size per node")
    add_option(p, "--max-num-seqs", type=int, default=64)
    add_option(p, "--max-batched-tokens", type=int, default=4096)
    add_option(p, "--heartbeat-ttl", type=float, default=6.0)
    add_option(
        p,
        "--no-kvcache",
        action="store_true",
        help="do not load prefixes from or store blocks in the kvcache service",
    )
    add_option(
        p,
        "--no-prefix-caching",
        action="store_true",
        help="never reuse KV across requests, not even from this node's own pool",
    )


def engine_from_args(args: argparse.Namespace) -> Engine:
    """Load the model and build the engine a prefill or decode node runs."""
    from shared.model.loader import load_model
    from tandem.runtime import configure_threads

    configure_threads(args.threads)
    model = load_model(args.model, dtype=args.dtype, device=args.device)
    return Engine(
        model,
        EngineConfig(
            kv_cache_bytes=args.kv_cache_mb << 20,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_batched_tokens,
            enable_prefix_caching=not args.no_prefix_caching,
        ),
    )


log = logging.getLogger("tandem.service")

LEFTOVER_GRACE = 5.0  # seconds for tasks still running once a service has shut down


def run_service(
    serve: Callable[[argparse.Namespace], Coroutine[Any, Any, None]], args: argparse.Namespace
) -> int:
    """Run a service's coroutine; a TandemError (bad model, bad option) is one line, exit 2."""
    try:
        asyncio.run(_with_bounded_end(serve(args)))
    except TandemError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Stopped as exc:
        print(f"stopped: {exc}", file=sys.stderr)
    return 0


async def _with_bounded_end(service: Coroutine[Any, Any, None]) -> None:
    try:
        await service
    finally:
        await end_leftover_tasks(LEFTOVER_GRACE)


async def end_leftover_tasks(grace: float) -> None:
    """Cancel the tasks a stopped service left running and wait for them, within `grace`.

    asyncio.run does the same but waits without a bound, so one task that swallows its
    cancellation keeps a stopped node alive until its orchestrator SIGKILLs it. A task
    still running after `grace` (cancelled again while it runs on: shared/tasks.py) is
    logged with where it waits, and the process ends at once (exit 1) with its logs and
    traces flushed.
    """
    me = asyncio.current_task()
    left = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
    if await cancel_and_wait(*left, timeout=grace):
        return
    stuck = [t for t in left if not t.done()]
    for task in stuck:
        frames = " <- ".join(
            f"{f.f_code.co_name} ({os.path.basename(f.f_code.co_filename)}:{f.f_lineno})"
            for f in reversed(task.get_stack())
        )
        log.warning("task %s ignored cancellation at shutdown: %s", task.get_name(), frames)
    from shared.telemetry.tracing import flush_tracing

    flush_tracing()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)  # asyncio.run would wait for the stuck task forever
