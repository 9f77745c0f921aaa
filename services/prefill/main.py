"""`tandem prefill`: run one prefill node until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging

from services.prefill.worker import PrefillWorker
from shared.bus.registry import NodeRegistry
from shared.node import connect_bus, make_node_id, setup_logging, stop_on_signals
from shared.telemetry.tracing import setup_tracing
from shared.transport.base import BufferHandler
from shared.transport.factory import make_transport
from tandem.service_options import (
    add_data_plane_options,
    add_engine_options,
    add_node_options,
    engine_from_args,
    run_service,
)

log = logging.getLogger("tandem.prefill")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("prefill", help="run a prefill node")
    add_node_options(p)
    add_data_plane_options(p)
    add_engine_options(p)
    p.set_defaults(func=run)


async def serve(args: argparse.Namespace) -> None:
    node_id = make_node_id("prefill", args.node_id)
    setup_logging("prefill", node_id, args.log_level)
    setup_tracing("prefill", node_id)
    engine = engine_from_args(args)
    stop = stop_on_signals()
    bus = await connect_bus(args.nats, node_id)
    transport = make_transport(args.transport, args.data_host, args.data_port)
    await transport.start(BufferHandler(max_bytes=0))  # a prefill node receives nothing yet
    registry = await NodeRegistry(bus, ttl=args.heartbeat_ttl).start()
    worker = PrefillWorker(engine, bus, transport, registry, node_id)
    beats = asyncio.create_task(registry.run_heartbeats(worker.info))
    port = worker.metrics.serve(args.metrics_port)
    if port is not None:
        log.info("metrics on http://127.0.0.1:%d/metrics", port)
    log.info("prefill node %s ready", node_id)
    try:
        await worker.run(stop)
    finally:
        beats.cancel()
        with contextlib.suppress(Exception):
            await registry.remove(node_id)
        await transport.close()
        await bus.close()
        worker.close()


def run(args: argparse.Namespace) -> int:
    return run_service(serve, args)
