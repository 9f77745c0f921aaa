"""`tandem autoscale` (a Docker Compose project) and the options `tandem up --autoscale` shares.

    tandem autoscale --nats nats://HOST:4222 --router-url http://HOST:8000 \\
        --project tandem --decode-max 4 --prefill-max 2

reads the cluster from NATS (credentials as for every service: TANDEM_NATS_USER/PASSWORD)
and scales the compose services `prefill` and `decode` through the Docker SDK. With
`tandem up --autoscale` the same controller scales the local stack's processes instead.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import threading
from threading import Thread
from typing import TYPE_CHECKING

from shared.bus.auth import BusAuth
from shared.bus.client import Bus
from shared.node import setup_logging, stop_on_signals
from tandem.autoscale.controller import Controller
from tandem.autoscale.policy import Policy, PolicyConfig
from tandem.autoscale.types import Backend, RoleBounds
from tandem.options import add_option
from tandem.service_options import add_nats_auth_options, run_service

if TYPE_CHECKING:
    from tandem.launcher import Stack

log = logging.getLogger("tandem.autoscale")


def add_policy_options(p: argparse.ArgumentParser) -> None:
    d = PolicyConfig()
    add_option(p, "--decode-min", type=int, default=1)
    add_option(p, "--decode-max", type=int, default=4)
    add_option(p, "--prefill-min", type=int, default=1)
    add_option(p, "--prefill-max", type=int, default=4)
    add_option(p, "--scale-interval", type=float, default=1.0, help="seconds between samples")
    add_option(
        p,
        "--decode-running-high",
        type=float,
        default=d.decode_running_high,
        help="running sequences per decode node that call for one more",
    )
    add_option(p, "--decode-running-low", type=float, default=d.decode_running_low)
    add_option(p, "--kv-used-high", type=float, default=d.kv_used_high)
    add_option(p, "--kv-used-low", type=float, default=d.kv_used_low)
    add_option(p, "--queue-high", type=float, default=d.queue_high, help="prefill jobs per node")
    add_option(p, "--ttft-high", type=float, default=d.ttft_high)
    add_option(p, "--ttft-low", type=float, default=d.ttft_low)
    add_option(p, "--up-window", type=float, default=d.up_window)
    add_option(p, "--down-window", type=float, default=d.down_window)
    add_option(p, "--scale-cooldown", type=float, default=d.cooldown)


def policy_from_args(args: argparse.Namespace) -> Policy:
    try:
        config = PolicyConfig(
            decode_running_high=args.decode_running_high,
            decode_running_low=args.decode_running_low,
            kv_used_high=args.kv_used_high,
            kv_used_low=args.kv_used_low,
            queue_high=args.queue_high,
            ttft_high=args.ttft_high,
            ttft_low=args.ttft_low,
            up_window=args.up_window,
            down_window=args.down_window,
            cooldown=args.scale_cooldown,
            bounds={
                "decode": RoleBounds(args.decode_min, args.decode_max),
                "prefill": RoleBounds(args.prefill_min, args.prefill_max),
            },
        )
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from exc
    return Policy(config)


async def run_controller(
    args: argparse.Namespace,
    backend: Backend,
    nats_url: str,
    auth: BusAuth,
    router_url: str | None,
    stop: asyncio.Event,
) -> None:
    bus = await Bus(nats_url, "autoscaler", auth).connect(stop=stop)
    try:
        controller = Controller(
            bus, backend, policy_from_args(args), router_url, interval=args.scale_interval
        )
        await controller.run(stop)
    finally:
        await bus.close()


def start_local(stack: Stack, args: argparse.Namespace, stopping: threading.Event) -> Thread:
    """`tandem up --autoscale`: the controller on a thread of its own, scaling the stack's
    processes until `stopping` is set."""
    from tandem.autoscale.local_backend import LocalBackend

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        threading.Thread(
            target=lambda: (stopping.wait(), loop.call_soon_threadsafe(stop.set)), daemon=True
        ).start()
        await run_controller(args, LocalBackend(stack), stack.nats_url, stack.auth, stack.url, stop)

    thread = threading.Thread(target=lambda: asyncio.run(main()), name="autoscale", daemon=True)
    thread.start()
    return thread


async def serve(args: argparse.Namespace) -> None:
    from tandem.autoscale.docker_backend import DockerBackend

    setup_logging("autoscale", "autoscaler", args.log_level)
    stop = stop_on_signals()
    backend = DockerBackend(args.project, drain_timeout=args.drain_timeout)
    log.info("autoscaling compose project %s", args.project)
    await run_controller(args, backend, args.nats, BusAuth.from_args(args), args.router_url, stop)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("autoscale", help="scale a compose project's prefill and decode nodes")
    add_option(p, "--nats", default="nats://127.0.0.1:4222", help="NATS server URL")
    add_nats_auth_options(p)
    add_option(p, "--router-url", default=None, help="router to read TTFT from")
    add_option(p, "--project", default="tandem", help="Docker Compose project name")
    add_option(
        p, "--drain-timeout", type=float, default=30.0, help="the decode nodes' --drain-timeout"
    )
    add_option(p, "--log-level", default="INFO")
    add_policy_options(p)
    p.set_defaults(func=lambda args: run_service(serve, args))
