"""`tandem decode`: run one decode node until SIGINT/SIGTERM.

Given several models (`--model` repeated, or a `--models-file`), the process hosts them
all: one engine per model, every engine on the process's one engine thread (so two busy
models step in turn), their KV pools drawing on one `--kv-cache-mb` budget
(shared/kv/shared_pool.py). Each model serves as a node of its own to the rest of the
cluster (its own id, registry entry, subjects and data-plane listener: `<id>` for the
first model, `<id>-m2`, `<id>-m3`... for the others), so routing, checkpoints and
failover work per model unchanged; a process that dies takes all of them with it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import logging
import os
from typing import Any

from shared.runtime import faults
from shared.runtime.node import NodeRuntime
from shared.runtime.options import (
    DEFAULT_MODEL,
    add_engine_node_parser,
    add_option,
    model_entries,
    thread_count,
    whole_number,
)
from shared.runtime.service import freeze_startup_objects, run_service
from shared.telemetry.logs import bind

log = logging.getLogger("tandem.decode")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_engine_node_parser(sub, "decode", "run a decode node", several_models=True)
    add_option(
        p,
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, finish running requests for up to this long (then hand them off)",
    )
    add_option(
        p,
        "--checkpoint-every",
        type=int,
        default=1,
        help="store a sequence's filled KV blocks in the kvcache service every N blocks, "
        "each followed by a checkpoint record in the journal (0: no checkpoints)",
    )
    add_option(
        p,
        "--no-checkpoint-tails",
        action="store_true",
        help="with checkpoints on, do not also store each sequence's partly filled last block "
        "after every step (a resume then recomputes up to a block instead of one token)",
    )
    add_option(
        p,
        "--checkpoint-tail-interval",
        type=float,
        default=0.25,
        help="seconds between two stores of the partly filled last blocks, at least (the "
        "steps in between go in one; a resume recomputes the tokens since the last; "
        "0: after every step)",
    )
    add_option(
        p,
        "--checkpoint-rate",
        type=float,
        default=0.0,
        help="MB per second the checkpoint blocks are stored at, at most (0: unpaced). On a "
        "2-core host, 50 cut the stall after a wave of prompts but slowed the other steps "
        "more: ~7%% fewer tokens/s (docs/benchmarks-log.md)",
    )
    add_lending_options(p)
    add_option(
        p,
        "--lease",
        type=float,
        default=5.0,
        help="cut off from NATS this long (no round trip to the server), drop every sequence: "
        "the routers resumed them elsewhere (at least the heartbeat TTL)",
    )
    add_option(
        p,
        "--engine-stall-timeout",
        type=float,
        default=20.0,
        help="an engine call (a step) running this long is a hung engine: the node takes no "
        "new work and answers probes 'stalled', so its streams move elsewhere",
    )
    add_option(
        p,
        "--decode-ahead",
        type=decode_ahead,
        default=1,
        help="run up to K engine steps per step, and stream each sequence's tokens of them "
        "together: fewer messages, burstier gaps; new requests wait up to K steps "
        "(shared/engine/ahead.py)",
    )
    p.set_defaults(func=run)


MAX_DECODE_AHEAD = 64  # shared/engine/ahead.py's MAX_AHEAD (a test keeps them equal)


def decode_ahead(text: str) -> int:
    """--decode-ahead: 1 (the default: a token a step) to MAX_DECODE_AHEAD. Checked here,
    not by importing the engine: parsing options must not load torch."""
    return whole_number(text, 1, MAX_DECODE_AHEAD)


def checkpoint_rate(given: float) -> float:
    """MB/s the checkpoint uploads are paced to (0: unpaced), checked."""
    if not given >= 0:
        raise SystemExit("--checkpoint-rate must be >= 0")
    return given


def add_lending_options(p: argparse.ArgumentParser) -> None:
    """Where the host's prefill nodes lend this node their cores (shared/runtime/core_share.py)."""
    add_option(
        p,
        "--core-share",
        default=None,
        help="a file of bytes shared with the prefill nodes on this host's cores: step on "
        "--lend-threads threads while none of them computes (tandem up sets it; "
        "shared/runtime/core_share.py)",
    )
    add_option(
        p,
        "--lend-threads",
        type=thread_count,
        default=0,
        help="torch threads of a step while the --core-share prefill nodes are idle "
        "(0: the process's cores)",
    )


async def serve(args: argparse.Namespace) -> None:
    # The engine (torch) and the worker load only when the node runs: the console script
    # that names this command also runs the router, which must not pay for them.
    from shared.kv.shared_pool import KVBudget
    from shared.runtime.core_share import LentCores
    from shared.runtime.engine import engine_from_args
    from shared.runtime.engine_thread import EngineThread

    if args.checkpoint_every < 0:
        raise SystemExit("--checkpoint-every must be >= 0")
    if not 0 <= args.checkpoint_tail_interval <= 60:
        raise SystemExit("--checkpoint-tail-interval must be between 0 and 60 seconds")
    rate = checkpoint_rate(args.checkpoint_rate)
    entries = model_entries(args, DEFAULT_MODEL)
    hosted = [
        argparse.Namespace(**(vars(args) | {"model": e.option, "dtype": e.dtype or args.dtype}))
        for e in entries
    ]
    first = await NodeRuntime.open("decode", hosted[0])
    runtimes = [first]
    thread = EngineThread(args.engine_cpus)
    workers: list[Any] = []
    warming: list[asyncio.Task[None]] = []
    try:
        await thread.pin()
        for i, margs in enumerate(hosted[1:], start=2):
            # Its own listener; its metrics on the process's port (the first node's).
            margs.data_port, margs.metrics_port = 0, None
            margs.node_id = f"{first.node_id}-m{i}"
            runtimes.append(await NodeRuntime.connect("decode", margs.node_id, margs, first.stop))
        budget = KVBudget(args.kv_cache_mb << 20) if len(hosted) > 1 else None
        contexts = []
        for rt, margs in zip(runtimes, hosted, strict=True):
            engine = await thread.call(engine_from_args, margs, budget)
            # Each model's node logs as itself: its tasks (subscriptions, loops) start in a
            # context naming its node and model (the process's default is the first node).
            context = contextvars.copy_context()
            context.run(bind, node_id=rt.node_id, model=engine.served_name)
            contexts.append(context)
            worker, warm = await asyncio.create_task(
                start_worker(rt, engine, thread, margs, rate), context=context
            )
            workers.append(worker)
            warming += [warm] if warm is not None else []
        if args.core_share:  # every model's steps, on the one engine thread
            lend = args.lend_threads or len(os.sched_getaffinity(0))
            lent = LentCores(args.core_share, min(args.threads or lend, lend), lend)
            for worker in workers:
                worker.lent = lent
        if len(workers) > 1:  # each node's heartbeat tells what its process runs in all
            for worker in workers:
                worker.siblings = [w.engine for w in workers]
                worker.host = first.node_id
            # the process's one metrics port (the first node's) serves every model's
            workers[0].metrics.serve_models({w.engine.served_name: w.metrics for w in workers})
        faults.install(thread)
        freeze_startup_objects()
        await asyncio.gather(
            *(
                asyncio.create_task(w.run(first.stop), context=c)
                for w, c in zip(workers, contexts, strict=True)
            )
        )
    finally:
        for task in warming:
            task.cancel()
        for rt in runtimes:
            await rt.close()
        for worker in workers:
            worker.close()
        if not workers:
            thread.close()


async def start_worker(
    rt: NodeRuntime, engine: Any, thread: Any, args: argparse.Namespace, rate: float
) -> tuple[Any, asyncio.Task[None] | None]:
    """One model's node in this process: its worker, subscribed, listening and live, and
    the task keeping its kvcache connections warm (None without a kvcache service)."""
    from services.decode.worker import DecodeWorker
    from shared.bus.journal import RequestJournal
    from shared.connector.planes import CheckpointSettings, KVPlanes
    from shared.connector.prefix_cache import PrefixCache

    assert rt.bus is not None and rt.transport is not None
    planes = KVPlanes.open(rt.bus, rt.transport, rt.registry, kvcache=not args.no_kvcache)
    prefix = journal = settings = None
    if planes.cache is not None:
        prefix = PrefixCache(engine, planes.cache, upload=False)  # loads for local prefills
        if args.checkpoint_every > 0:
            tail_interval = None if args.no_checkpoint_tails else args.checkpoint_tail_interval
            settings = CheckpointSettings(args.checkpoint_every, rate, tail_interval)
            journal = await RequestJournal(rt.bus).start()
    worker = DecodeWorker(
        engine,
        rt.bus,
        rt.node_id,
        planes=planes,
        registry=rt.registry,
        drain_timeout=args.drain_timeout,
        lease=max(args.lease, args.heartbeat_ttl),
        prefix=prefix,
        checkpoints=settings,
        journal=journal,
        thread=thread,
        stall_timeout=args.engine_stall_timeout,
    )
    await planes.listen(worker.receiver)
    await worker.subscribe()
    await rt.live(worker.info, worker.metrics, worker.health)
    warming = planes.keep_warm(rt.stop)  # checkpoints' and prefix loads' first gets
    log.info(
        "decode node %s ready (%s): %d KV blocks, data plane %s",
        rt.node_id,
        engine.served_name,
        engine.pool.num_blocks,
        planes.address,
    )
    return worker, warming


def run(args: argparse.Namespace) -> int:
    return run_service(serve, args)
