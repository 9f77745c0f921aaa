"""`tandem kvcache`: run one KV-cache node until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from services.kvcache.peers import Peers
from services.kvcache.store import BlockStore
from services.kvcache.tails import TAIL_TTL, TailStore
from services.kvcache.worker import KVCacheWorker
from shared.runtime.node import NodeRuntime
from shared.runtime.options import add_data_plane_options, add_node_options, add_option
from shared.runtime.service import freeze_startup_objects, run_service

log = logging.getLogger("tandem.kvcache")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("kvcache", help="run a KV-cache node (block store by hash)")
    add_node_options(p, model=False)
    add_data_plane_options(p)
    add_option(p, "--capacity-mb", type=int, default=1024, help="memory for stored blocks")
    add_option(
        p,
        "--disk-mb",
        type=int,
        default=0,
        help="disk tier for blocks spilled from memory (0: off)",
    )
    add_option(p, "--disk-dir", default=None, help="directory of the disk tier's arena file")
    add_option(
        p,
        "--tail-mb",
        type=int,
        default=0,
        help="memory for running requests' partly filled last blocks (0: an eighth of "
        "--capacity-mb, at least 64)",
    )
    add_option(
        p,
        "--tail-ttl",
        type=float,
        default=TAIL_TTL,
        help="seconds a request's partial last block is kept after its last write",
    )
    add_option(p, "--heartbeat-ttl", type=float, default=6.0)
    p.set_defaults(func=run)


async def serve(args: argparse.Namespace) -> None:
    if args.disk_mb < 0 or args.capacity_mb <= 0:
        raise SystemExit("tandem kvcache: --capacity-mb must be > 0 and --disk-mb >= 0")
    if args.tail_mb < 0 or args.tail_ttl <= 0:
        raise SystemExit("tandem kvcache: --tail-mb must be >= 0 and --tail-ttl > 0")
    if args.disk_mb and not args.disk_dir:
        raise SystemExit("tandem kvcache: --disk-mb needs --disk-dir")
    rt = await NodeRuntime.open("kvcache", args)
    assert rt.bus is not None and rt.transport is not None
    disk_dir = Path(args.disk_dir) / rt.node_id if args.disk_dir else None
    store = BlockStore(args.capacity_mb << 20, args.disk_mb << 20, disk_dir)
    tail_mb = args.tail_mb or max(64, args.capacity_mb // 8)
    tails = TailStore(tail_mb << 20, args.tail_ttl)
    assert rt.registry is not None
    peers = Peers(rt.registry)  # it sends blocks only to registered nodes
    worker = KVCacheWorker(store, rt.bus, rt.transport, rt.node_id, tails, peers)
    try:
        await rt.transport.start(worker)
        await worker.subscribe()
        await rt.live(worker.info, worker.metrics)
        log.info(
            "kvcache node %s ready: %d MiB memory, %d MiB disk, at %s",
            rt.node_id,
            args.capacity_mb,
            args.disk_mb,
            rt.transport.address,
        )
        freeze_startup_objects()
        await rt.stop.wait()
    finally:
        await worker.close()
        await rt.close()
        store.close()


def run(args: argparse.Namespace) -> int:
    return run_service(serve, args)
