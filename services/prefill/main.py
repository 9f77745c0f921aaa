"""`tandem prefill`: run one prefill node until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging

from shared.runtime.node import NodeRuntime
from shared.runtime.options import (
    PREFILL_MAX_BATCH,
    PREFILL_STEP_TOKENS,
    add_engine_node_parser,
    add_option,
    positive,
    thread_count,
    whole_number,
)
from shared.runtime.service import freeze_startup_objects, run_service

log = logging.getLogger("tandem.prefill")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_engine_node_parser(sub, "prefill", "run a prefill node")
    add_option(
        p,
        "--max-batch",
        type=positive,
        default=PREFILL_MAX_BATCH,
        help="jobs fetched together at most (prefilled in steps, --step-tokens)",
    )
    add_option(
        p,
        "--step-tokens",
        type=positive,
        default=PREFILL_STEP_TOKENS,
        help="prompt tokens one prefill step computes at most (a longer prompt runs alone; "
        "the smaller of this and --max-batched-tokens): each step's first tokens go out as "
        "it ends, the next step computing meanwhile",
    )
    add_option(
        p,
        "--idle-threads",
        type=thread_count,
        default=0,
        help="torch threads for a batch whose every job the router sent while it served "
        "nothing else (0: --threads): on a host whose cores this node shares with the "
        "decode node, the decode node is idle then and its core free",
    )
    add_option(
        p,
        "--core-share",
        default=None,
        help="a file of bytes shared with the decode node on this host's cores, which steps "
        "on this node's cores while it is idle (tandem up sets it; "
        "shared/runtime/core_share.py)",
    )
    add_option(
        p,
        "--core-share-slot",
        type=lambda text: whole_number(text, 0, 62),
        default=0,
        help="this node's byte in --core-share (each prefill node on the host its own)",
    )
    p.set_defaults(func=run)


async def serve(args: argparse.Namespace) -> None:
    # The engine (torch) and the worker load only when the node runs: the console script
    # that names this command also runs the router, which must not pay for them.
    from services.prefill.worker import PrefillWorker
    from shared.connector.planes import KVPlanes
    from shared.runtime.core_share import CoreClaim
    from shared.runtime.engine import start_engine

    if args.engine != "native":
        # its KV would have to reach a decode node: vLLM's engine has no Tandem KV
        # connector yet (docs/engines.md)
        raise SystemExit(
            f"a prefill node runs the native engine only (not --engine {args.engine}) until "
            "the KV connector hands vLLM's KV off; serve vLLM colocated: tandem up --engine vllm"
        )
    # a prefill node's engine steps are its --step-tokens (engine_from_args reads this)
    args.max_batched_tokens = min(args.max_batched_tokens, args.step_tokens)
    rt = await NodeRuntime.open("prefill", args)
    assert rt.bus is not None and rt.transport is not None and rt.registry is not None
    engine, thread = await start_engine(args)
    # a prefill node receives only the kvcache blocks it asked for
    planes = KVPlanes.open(rt.bus, rt.transport, rt.registry, kvcache=not args.no_kvcache)
    worker = PrefillWorker(
        engine,
        rt.bus,
        planes,
        rt.registry,
        rt.node_id,
        max_batch=args.max_batch,
        thread=thread,
        idle_threads=args.idle_threads,
        claim=CoreClaim(args.core_share, args.core_share_slot) if args.core_share else None,
    )
    warming: asyncio.Task[None] | None = None
    try:
        await planes.listen()
        await rt.live(worker.info, worker.metrics)
        warming = planes.keep_warm(rt.stop)  # prefix loads' first gets find it open
        log.info("prefill node %s ready", rt.node_id)
        freeze_startup_objects()
        await worker.run(rt.stop)
    finally:
        if warming is not None:
            warming.cancel()
        await rt.close()
        worker.close()


def run(args: argparse.Namespace) -> int:
    return run_service(serve, args)
