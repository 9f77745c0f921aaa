"""What a model-serving node (prefill, decode) sets up before it serves: its torch threads
and its engine. Only those nodes import this module; it is the one that loads torch.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
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
    if getattr(args, "engine", "native") == "vllm":
        return vllm_engine_from_args(args, budget)
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


def vllm_engine_from_args(args: argparse.Namespace, budget: KVBudget | None) -> EngineCore:
    """vLLM's engine on the node's model (shared/engine/vllm/), as far as it serves today:
    one model a process, colocated (no KV hand-off in or out), one token a step."""
    if budget is not None:
        raise SystemExit("--engine vllm: one model a node (vLLM's engine owns its KV memory)")
    if getattr(args, "decode_ahead", 1) > 1:
        raise SystemExit("--engine vllm: --decode-ahead is the native engine's")
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit(
            f"--engine vllm: vLLM is not installed in {sys.prefix}: run the node with the "
            "python of the environment `make vllm` builds (.venv-vllm/bin/python)"
        )
    from shared.engine.vllm.engine import VllmConfig, VllmEngine
    from shared.model.convert import converted_dir
    from shared.model.source import resolve_model

    source = resolve_model(args.model)
    return VllmEngine(
        VllmConfig(
            model_dir=str(converted_dir(source)),
            served_name=source.served_name,
            dtype=args.dtype,
            kv_cache_bytes=args.kv_cache_mb << 20,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_batched_tokens,
            enable_prefix_caching=not args.no_prefix_caching,
        )
    )


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
