"""`tandem kvcache`: run one KV-cache node until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging

from services.kvcache.store import BlockStore
from services.kvcache.worker import KVCacheWorker
from shared.bus.registry import NodeRegistry
from shared.node import connect_bus, make_node_id, setup_logging, stop_on_signals
from shared.telemetry.tracing import setup_tracing
from shared.transport.factory import make_transport
from tandem.options import add_option
from tandem.service_options import add_data_plane_options, add_node_options, run_service

log = logging.getLogger("tandem.kvcache")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("kvcache", help="run a KV-cache node (block store by hash)")
    add_node_options(p, model=False)
    add_data_plane_options(p)
    add_option(p, "--capacity-mb", type=int, default=1024, help="memory for stored blocks")
    add_option(p, "--heartbeat-ttl", type=float, default=6.0)
    p.set_defaults(func=run)


async def serve(args: argparse.Namespace) -> None:
    node_id = make_node_id("kvcache", args.node_id)
    setup_logging("kvcache", node_id, args.log_level)
    setup_tracing("kvcache", node_id)
    stop = stop_on_signals()
    bus = await connect_bus(args.nats, node_id)
    transport = make_transport(args.transport, args.data_host, args.data_port)
    worker = KVCacheWorker(BlockStore(args.capacity_mb << 20), bus, transport, node_id)
    await transport.start(worker)
    await worker.subscribe()
    registry = await NodeRegistry(bus, ttl=args.heartbeat_ttl).start()
    beats = asyncio.create_task(registry.run_heartbeats(worker.info))
    port = worker.metrics.serve(args.metrics_port)
    if port is not None:
        log.info("metrics on http://127.0.0.1:%d/metrics", port)
    log.info(
        "kvcache node %s ready: %d MiB, data plane %s", node_id, args.capacity_mb, transport.address
    )
    try:
        await stop.wait()
    finally:
        beats.cancel()
        with contextlib.suppress(Exception):
            await registry.remove(node_id)
        await transport.close()
        await bus.close()


def run(args: argparse.Namespace) -> int:
    return run_service(serve, args)
