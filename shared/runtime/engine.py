"""What a model-serving node (prefill, decode) sets up before it serves: its torch threads
and its engine. Only those nodes import this module; it is the one that loads torch.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from shared.engine.ahead import DecodeAhead
from shared.engine.engine import Engine, EngineConfig
from shared.engine.interface import EngineCore
from shared.kv.shared_pool import KVBudget
from shared.runtime.engine_thread import EngineThread


def configure_threads(threads: int | None) -> int:
    """Set torch's thread count to the cores this process may use, and return it.

    Oversubscribed cores are catastrophic for decode latency (measured 7-17x slower per
    step with two busy processes on two cores), so each process takes exactly the cores
    its affinity mask grants unless told otherwise.
    """
    n = threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(max(1, n))
    return n


@contextmanager
def torch_threads(threads: int) -> Iterator[int]:
    """Run the block on `threads` torch threads (0: the count set now), then go back;
    yields the count in effect. Call it on the thread that runs the block: with OpenMP
    the count is each thread's own setting. Growing the team starts its new threads with
    this thread's CPUs."""
    before = torch.get_num_threads()
    if not threads or threads == before:
        yield before
        return
    torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(before)


def engine_from_args(args: argparse.Namespace, budget: KVBudget | None = None) -> EngineCore:
    """Load the model and build the engine a prefill or decode node runs (`budget`: KV
    memory shared with the node's other models' engines; a decode node's `--decode-ahead`
    K > 1 runs K of its steps per step, shared/engine/ahead.py)."""
    from shared.model.loader import load_model

    configure_threads(args.threads)
    model = load_model(args.model, dtype=args.dtype, device=args.device)
    engine = Engine(
        model,
        EngineConfig(
            kv_cache_bytes=args.kv_cache_mb << 20,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_batched_tokens,
            enable_prefix_caching=not args.no_prefix_caching,
            step_token_budget=args.step_token_budget,
            prefill_chunk_tokens=args.prefill_chunk_tokens,
            prefill_bursts=not args.no_prefill_bursts,
        ),
        budget,
    )
    ahead = getattr(args, "decode_ahead", 1)
    return DecodeAhead(engine, ahead) if ahead > 1 else engine


async def start_engine(args: argparse.Namespace) -> tuple[EngineCore, EngineThread]:
    """Build the node's engine on the thread that will run it, and return both.

    Built anywhere else, the model load leaves a second OpenMP team behind and every step
    runs slower (engine_thread.py says why)."""
    thread = EngineThread(args.engine_cpus)
    try:
        await thread.pin()
        return await thread.call(engine_from_args, args), thread
    except BaseException:
        thread.close()
        raise
