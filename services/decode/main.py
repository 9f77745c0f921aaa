"""`tandem decode`: run one decode node until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging

from services.decode.worker import DecodeWorker
from shared.bus.registry import NodeRegistry
from shared.node import connect_bus, make_node_id, setup_logging, stop_on_signals
from shared.telemetry.tracing import setup_tracing
from shared.transport.factory import make_transport
from tandem.service_options import (
    add_data_plane_options,
    add_engine_options,
    add_node_options,
    engine_from_args,
    run_service,
)

log = logging.getLogger("tandem.decode")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("decode", help="run a decode node")
    add_node_options(p)
    add_data_plane_options(p)
    add_engine_options(p)
    p.set_defaults(func=run)


async def serve(args: argparse.Namespace) -> None:
    node_id = make_node_id("decode", args.node_id)
    setup_logging("decode", node_id, args.log_level)
    setup_tracing("decode", node_id)
    engine = engine_from_args(args)
    stop = stop_on_signals()
    bus = await connect_bus(args.nats, node_id)
    transport = make_transport(args.transport, args.data_host, args.data_port)
    worker = DecodeWorker(engine, bus, node_id, transport_name=args.transport)
    await transport.start(worker)
    worker.data_address = transport.address
    await worker.subscribe()
    registry = await NodeRegistry(bus, ttl=args.heartbeat_ttl).start()
    beats = asyncio.create_task(registry.run_heartbeats(worker.info))
    port = worker.metrics.serve(args.metrics_port)
    if port is not None:
        log.info("metrics on http://127.0.0.1:%d/metrics", port)
    log.info(
        "decode node %s ready: %d KV blocks, data plane %s",
        node_id,
        engine.pool.num_blocks,
        transport.address,
    )
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
