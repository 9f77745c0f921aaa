"""`tandem plan profile`: measure, with the real engine and data plane, what a deployment's
time is made of on this machine, and write it as a versioned JSON profile (shared/costs/profile.py).

- prefill: seconds for a prompt of N tokens, alone and batched (the prefill node's work);
- decode: seconds for one engine step at batch B over contexts of C tokens;
- transfer: seconds to move S bytes over each data plane (TCP and UCX) from this process
  to a receiver process (transfer_peer.py);
- KV copies on the engine thread, against tokens (at the prefill grid's lengths): a
  prefill node's export of a prompt's KV, a decode node's import of it, a prefix loaded
  from kvcache into the pool, and a decode node's checkpoint copy of its filled blocks
  (their network share is the transfer points').

Every point is the median of `--repeats` runs after a warm-up run. The default grid takes
about ten minutes on 2 cores; `--quick` a reduced grid in a few.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from shared.costs.profile import (
    PROFILE_VERSION,
    DecodePoint,
    KVCopyOp,
    KVCopyPoint,
    Machine,
    PrefillPoint,
    Profile,
    TransferPoint,
)
from shared.errors import TandemError
from shared.runtime.options import add_model_options, add_option
from shared.transport.kinds import TRANSPORTS as DATA_PLANES

if TYPE_CHECKING:  # torch and the engine load only when a profile is measured
    from shared.engine.engine import Engine

TRANSPORTS = tuple(sorted(DATA_PLANES))  # both data planes, each between two processes
PEER_TIMEOUT = 60.0  # seconds for the receiver process to listen (ucxx imports slowly)


@dataclass(frozen=True)
class Grid:
    prefill_tokens: tuple[int, ...]
    prefill_batches: tuple[int, ...]  # at the grid's middle prompt length
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    transfer_bytes: tuple[int, ...]
    transports: tuple[str, ...] = TRANSPORTS


FULL = Grid(
    prefill_tokens=(64, 128, 256, 512, 1024, 2048),
    prefill_batches=(2, 4, 8),
    decode_batches=(1, 2, 4, 8, 16, 32),
    decode_contexts=(128, 512, 2048),
    transfer_bytes=(1 << 16, 1 << 20, 1 << 24, 1 << 26),
)
QUICK = Grid(
    prefill_tokens=(64, 256, 1024),
    prefill_batches=(4,),
    decode_batches=(1, 8, 16),
    decode_contexts=(128, 1024),
    transfer_bytes=(1 << 16, 1 << 22),
)
# What `tandem up` measures on a first start to pick its serving mode (tandem/plan/pick.py):
# the points the mode ranking reads, in well under a minute on one core. The transport is
# set to the stack's own by `startup_grid`.
STARTUP = Grid(
    prefill_tokens=(64, 256, 1024),
    prefill_batches=(4,),
    decode_batches=(1, 8, 16),
    decode_contexts=(128, 1024),
    transfer_bytes=(1 << 16, 1 << 22),
    transports=("tcp",),
)
GRIDS = {"full": FULL, "quick": QUICK, "startup": STARTUP}


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("profile", help="measure this machine's costs into a JSON profile")
    add_option(p, "--output", default="profile.json", help="where the profile goes")
    add_model_options(p)
    add_option(p, "--quick", action="store_true", help="a reduced grid, for smoke runs")
    add_option(
        p,
        "--grid",
        choices=sorted(GRIDS),
        default=None,
        help="the points measured: full (default), quick (as --quick), or startup (what "
        "`tandem up` measures to pick its mode: under a minute)",
    )
    add_option(
        p,
        "--transport",
        choices=TRANSPORTS,
        default=None,
        help="measure this data plane only (default: the grid's: both, or tcp for startup)",
    )
    add_option(p, "--repeats", type=int, default=3, help="runs per point (the median is kept)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1:
        print("error: --repeats must be at least 1", file=sys.stderr)
        return 2
    grid = GRIDS[args.grid or ("quick" if args.quick else "full")]
    if args.transport:
        grid = replace(grid, transports=(args.transport,))
    try:
        profile = measure(args, grid)
    except TandemError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    Path(args.output).write_bytes(msgspec.json.format(msgspec.json.encode(profile)))
    print(f"profile written to {args.output}")
    return 0


def fit(grid: Grid, context: int) -> Grid:
    """The grid with no sequence longer than the model's `context` (0: unknown, as it is):
    each longer length comes down to the longest that fits, beside a decode step's few
    tokens."""
    if context <= 0:
        return grid
    most = max(16, context - 16)

    def cap(lengths: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(sorted({min(n, most) for n in lengths}))

    return replace(
        grid, prefill_tokens=cap(grid.prefill_tokens), decode_contexts=cap(grid.decode_contexts)
    )


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: allocator, threads, caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(args: argparse.Namespace, grid: Grid) -> Profile:
    # torch and the engine load only when this runs (the console script serves the router)
    import torch
    from tqdm import tqdm

    from shared.model.loader import load_model
    from shared.runtime.engine import configure_threads

    threads = configure_threads(args.threads)
    model = load_model(args.model, dtype=args.dtype, device=args.device)
    grid = fit(grid, int(getattr(model.config, "max_position_embeddings", 0) or 0))
    total = (
        len(grid.prefill_tokens)
        + len(grid.prefill_batches)
        + len(grid.decode_batches) * len(grid.decode_contexts)
        + len(grid.transfer_bytes) * len(grid.transports)
        + len(grid.prefill_tokens)
    )
    with tqdm(total=total, desc="profile", unit="point", file=sys.stderr) as bar:
        prefill = _prefill_points(model, grid, args.repeats, bar)
        decode = _decode_points(model, grid, args.repeats, bar)
        transfer = _transfer_points(grid, args.repeats, bar)
        kv_copy = _kv_copy_points(model, grid, args.repeats, bar)
    from shared.model.runner import kv_layout

    layout = kv_layout(model, 16)
    return Profile(
        version=PROFILE_VERSION,
        machine=_machine(str(model.device)),
        model=model.served_name,
        dtype=args.dtype,
        threads=threads,
        torch=str(torch.__version__),
        kv_bytes_per_token=layout.bytes_per_block // layout.block_size,
        prefill=prefill,
        decode=decode,
        transfer=transfer,
        created=time.time(),
        kv_copy=kv_copy,
    )


def _prompt(n: int, rng: random.Random, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def _prefill_points(model: object, grid: Grid, repeats: int, bar: object) -> list[PrefillPoint]:
    from shared.engine.engine import Engine, EngineConfig
    from shared.engine.prefill_steps import prefill_and_export
    from shared.sampling_params import SamplingParams

    rng = random.Random(1)
    vocab = int(model.config.vocab_size)  # type: ignore[attr-defined]
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    most = max(max(grid.prefill_tokens), max(grid.prefill_batches) * max(grid.prefill_tokens))
    # one engine for every point: a prefill hands its KV out and frees its blocks
    config = EngineConfig(num_blocks=most // 16 + 16, enable_prefix_caching=False)
    engine = Engine(model, config)  # type: ignore[arg-type]
    ids = iter(range(1 << 62))
    points = []

    def prefill(tokens: int, batch: int) -> float:
        prompts = [_prompt(tokens, rng, vocab) for _ in range(batch)]

        def once() -> None:
            prefill_and_export(engine, [(f"p{next(ids)}", p, params) for p in prompts])

        return median_seconds(once, repeats)

    for tokens in grid.prefill_tokens:
        points.append(PrefillPoint(tokens=tokens, batch=1, seconds=prefill(tokens, 1)))
        bar.update()  # type: ignore[attr-defined]
    middle = grid.prefill_tokens[len(grid.prefill_tokens) // 2]
    for batch in grid.prefill_batches:
        points.append(PrefillPoint(tokens=middle, batch=batch, seconds=prefill(middle, batch)))
        bar.update()  # type: ignore[attr-defined]
    return points


def _decode_points(model: object, grid: Grid, repeats: int, bar: object) -> list[DecodePoint]:
    """A decode step's time at each batch and context. A batch is one prompt prefilled
    once, then imported `batch` times: a step's cost does not depend on what its KV holds,
    and prefilling every sequence (32 x 2,048 tokens on the full grid) took most of the
    profile's time."""
    from shared.engine.engine import Engine, EngineConfig
    from shared.sampling_params import SamplingParams

    rng = random.Random(2)
    vocab = int(model.config.vocab_size)  # type: ignore[attr-defined]
    points = []
    params = SamplingParams(max_tokens=repeats + 3, temperature=0, ignore_eos=True)
    for context in grid.decode_contexts:
        source = Engine(
            model,  # type: ignore[arg-type]
            EngineConfig(num_blocks=context // 16 + 4, enable_prefix_caching=False),
        )
        rid = source.add_request(_prompt(context, rng, vocab), params)
        while not source.requests[rid].output_ids:
            source.step()  # its prompt's KV is in the pool now
        snapshot, frame = source.export(rid)
        for batch in grid.decode_batches:
            blocks = batch * ((context + repeats + 3) // 16 + 2)
            config = EngineConfig(num_blocks=blocks, enable_prefix_caching=False)
            engine = Engine(model, config)  # type: ignore[arg-type]
            for i in range(batch):
                engine.add_snapshot(replace(snapshot, request_id=f"{rid}-{i}"), frame)
            seconds = median_seconds(engine.step, repeats)
            points.append(DecodePoint(batch=batch, context=context, seconds=seconds))
            bar.update()  # type: ignore[attr-defined]
    return points


def _kv_copy_points(model: object, grid: Grid, repeats: int, bar: object) -> list[KVCopyPoint]:
    """The engine's own copies, at each prefill length (`_kv_copies`)."""
    from shared.engine.engine import Engine, EngineConfig

    rng = random.Random(3)
    vocab = int(model.config.vocab_size)  # type: ignore[attr-defined]
    # room for a prompt, plus its imported copy and a loaded prefix on the second engine
    blocks = 2 * (max(grid.prefill_tokens) // 16 + 2)
    config = EngineConfig(num_blocks=blocks, enable_prefix_caching=True)
    source, target = Engine(model, config), Engine(model, config)  # type: ignore[arg-type]
    points = []
    for tokens in grid.prefill_tokens:
        points += _kv_copies(source, target, _prompt(tokens, rng, vocab), repeats)
        bar.update()  # type: ignore[attr-defined]
    return points


def _kv_copies(
    source: Engine, target: Engine, prompt: list[int], repeats: int
) -> list[KVCopyPoint]:
    """A prompt prefilled on `source`, exported, imported by `target` (then dropped), its
    blocks copied out as a checkpoint does, and placed into `target`'s pool as a prefix
    fetched from kvcache would be."""
    from shared.kv.block_hash import BlockHash
    from shared.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    rid = source.add_request(prompt, params)
    seq = source.requests[rid]
    while not seq.output_ids:
        source.step()  # its prompt's KV is in the pool now
    snapshot, frame = source.export(rid)
    ids = seq.block_ids[: source.scheduler.blocks_for(seq.num_computed)]
    copies = source.exchange.block_bytes(ids)
    fresh = itertools.count()

    def imported() -> None:
        target.add_snapshot(snapshot, frame)
        target.abort(snapshot.request_id)

    def loaded() -> None:  # new hashes each time: a pool holding them skips them
        n = next(fresh)
        names = [BlockHash(f"{rid}-{n}-{i}".encode()) for i in range(len(copies))]
        target.exchange.import_cached_blocks(names, copies)

    timed: dict[KVCopyOp, Callable[[], object]] = {
        "export": lambda: source.export(rid),
        "import": imported,
        "load": loaded,
        "checkpoint": lambda: source.exchange.block_bytes(ids),
    }
    points = [
        KVCopyPoint(op=op, tokens=seq.num_computed, seconds=median_seconds(fn, repeats))
        for op, fn in timed.items()
    ]
    source.abort(rid)
    return points


def _transfer_points(grid: Grid, repeats: int, bar: object) -> list[TransferPoint]:
    points = []
    for kind in grid.transports:
        points += asyncio.run(_transfers(kind, grid, repeats, bar))
    return points


async def _transfers(kind: str, grid: Grid, repeats: int, bar: object) -> list[TransferPoint]:
    """Sends of each size from this process to a receiver process (transfer_peer.py)."""
    from shared.transport.base import BufferHandler
    from shared.transport.factory import make_transport
    from shared.transport.frames import make_header

    peer = subprocess.Popen(
        [sys.executable, "-m", "tandem.plan.transfer_peer", kind],
        stdout=subprocess.PIPE,
        text=True,
    )
    sender = make_transport(kind)
    points = []
    try:
        address = await asyncio.wait_for(asyncio.to_thread(_first_line, peer), PEER_TIMEOUT)
        await sender.start(BufferHandler(max_bytes=0))  # the profile only sends
        for size in grid.transfer_bytes:
            payload = memoryview(os.urandom(size))
            times = []
            for i in range(repeats + 1):
                header = make_header("profile", uuid.uuid4().hex, payload)
                start = time.perf_counter()
                await sender.send(address, header, payload, timeout=60)
                if i:  # the first one warms the connection
                    times.append(time.perf_counter() - start)
            points.append(
                TransferPoint(transport=kind, bytes=size, seconds=statistics.median(times))
            )
            bar.update()  # type: ignore[attr-defined]
    except TimeoutError as exc:
        raise TandemError(f"the {kind} receiver did not start within {PEER_TIMEOUT:g}s") from exc
    finally:
        await sender.close()
        peer.kill()
        peer.wait()
        if peer.stdout is not None:
            peer.stdout.close()
    return points


def _first_line(peer: subprocess.Popen[str]) -> str:
    assert peer.stdout is not None
    line = peer.stdout.readline().strip()
    if not line:
        raise TandemError(f"the transfer receiver exited ({peer.wait()}) before listening")
    return line


def cpu_flags() -> list[str]:
    """The CPU flags that decide a dtype's speed (avx2, avx512*, amx*), sorted; none where
    /proc/cpuinfo is not (not Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return sorted(
        {
            f
            for f in line.split(":", 1)[-1].split()
            if f == "avx2" or f.startswith(("avx512", "amx"))
        }
    )


def cpu_name() -> str:
    """The CPU's model name ("unknown" where neither platform nor /proc/cpuinfo says)."""
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu in ("unknown", ""):
                cpu = line.split(":", 1)[1].strip()
    except OSError:  # not Linux: the CPU's name from platform is all there is
        pass
    return cpu


def _machine(device: str) -> Machine:
    cores = len(os.sched_getaffinity(0))
    return Machine(cpu=cpu_name(), cpu_flags=cpu_flags(), cores=cores, device=device)
