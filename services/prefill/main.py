"""`tandem prefill`: run one prefill node until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging

from services.prefill.worker import PrefillWorker
from shared.bus.registry import NodeRegistry
from shared.engine.engine import Engine, EngineConfig
from shared.errors import TandemError
from shared.node import connect_bus, make_node_id, setup_logging, stop_on_signals
from shared.transport.base import BufferHandler
from shared.transport.factory import make_transport
from tandem.runtime import configure_threads
from tandem.service_options import add_data_plane_options, add_engine_options, add_node_options

log = logging.getLogger("tandem.prefill")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("prefill", help="run a prefill node")
    add_node_options(p)
    add_data_plane_options(p)
    add_engine_options(p)
    p.set_defaults(func=run)


async def serve(args: argparse.Namespace) -> None:
    from shared.model.loader import load_model

    node_id = make_node_id("prefill", args.node_id)
    setup_logging("prefill", node_id, args.log_level)
    configure_threads(args.threads)
    model = load_model(args.model, dtype=args.dtype, device=args.device)
    engine = Engine(
        model,
        EngineConfig(
            kv_cache_bytes=args.kv_cache_mb << 20,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_batched_tokens,
        ),
    )
    stop = stop_on_signals()
    bus = await connect_bus(args.nats, node_id)
    transport = make_transport(args.transport, args.data_host, args.data_port)
    await transport.start(BufferHandler(max_bytes=0))  # a prefill node receives nothing yet
    registry = await NodeRegistry(bus, ttl=args.heartbeat_ttl).start()
    worker = PrefillWorker(engine, bus, transport, registry, node_id)
    beats = asyncio.create_task(registry.run_heartbeats(worker.info))
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
    try:
        asyncio.run(serve(args))
    except TandemError as exc:
        print(f"error: {exc}")
        return 2
    return 0
