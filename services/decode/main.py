"""`tandem decode`: run one decode node until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import logging

from services.decode.worker import DecodeWorker
from shared.kv_uploader import BlockUploader
from shared.kvclient import KVCacheClient
from shared.node import NodeRuntime
from shared.transport.pending import PendingTransfers
from tandem.options import add_option
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
    add_option(
        p,
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, finish running requests for up to this long (then hand them off)",
    )
    p.set_defaults(func=run)


async def serve(args: argparse.Namespace) -> None:
    rt = await NodeRuntime.open("decode", args)
    assert rt.bus is not None and rt.transport is not None
    engine = engine_from_args(args)
    uploader = None
    if not args.no_kvcache:  # decode only puts: gets would need a PendingTransfers handler
        client = KVCacheClient(rt.bus, rt.transport, PendingTransfers(), rt.registry)
        uploader = BlockUploader(client)
    worker = DecodeWorker(
        engine,
        rt.bus,
        rt.node_id,
        transport_name=args.transport,
        uploader=uploader,
        drain_timeout=args.drain_timeout,
    )
    registry = rt.registry
    assert registry is not None
    worker.announce = lambda: registry.heartbeat(worker.info())
    try:
        await rt.transport.start(worker)
        worker.data_address = rt.transport.address
        await worker.subscribe()
        await rt.live(worker.info, worker.metrics)
        log.info(
            "decode node %s ready: %d KV blocks, data plane %s",
            rt.node_id,
            engine.pool.num_blocks,
            rt.transport.address,
        )
        await worker.run(rt.stop)
    finally:
        await rt.close()
        worker.close()


def run(args: argparse.Namespace) -> int:
    return run_service(serve, args)
