"""What a put costs the kvcache node's store: into never-used slabs, into slabs faulted in
ahead (`services/kvcache/prefault.py`), and into slabs used before.

Each round builds a fresh store per side, interleaved, and puts the same blocks (SmolLM2's
KV block: 16 tokens x 30 layers x K and V x 3 heads x 64 x float32 = 737,280 bytes); it
prints the median time per block over the rounds, and what faulting in ahead cost (done
here before the puts, for the whole run; the node keeps up to 128 MB ahead, between puts).

    .venv/bin/python benchmarks/kvcache_put.py [--blocks 256] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from services.kvcache import prefault  # noqa: E402
from services.kvcache.prefault import prefault_step  # noqa: E402
from services.kvcache.store import BlockStore  # noqa: E402
from tandem.plan.profile import cpu_flags  # noqa: E402

BLOCK = 737_280


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def new_store(capacity: int, block: memoryview) -> BlockStore:
    """A store whose size class exists (its first put, under a key no run uses)."""
    store = BlockStore(capacity)
    store.put(b"first".ljust(16, b"\0"), block)
    return store


def put_all(store: BlockStore, blocks: list[memoryview]) -> float:
    """Seconds to store every block (their hashes are new to the store)."""
    started = time.perf_counter()
    for i, data in enumerate(blocks):
        store.put(key(i), data)
    return time.perf_counter() - started


def one_round(blocks: list[memoryview], capacity: int) -> dict[str, float]:
    seconds: dict[str, float] = {}
    # never used: the put faults in each page
    store = new_store(capacity, blocks[0])
    seconds["fresh"] = put_all(store, blocks)
    store.close()
    # faulted in ahead, as the node's background task does between puts
    store = new_store(capacity, blocks[0])
    started = time.perf_counter()
    while prefault_step(store, 1 << 30):
        pass
    seconds["prefault itself"] = time.perf_counter() - started
    seconds["faulted in ahead"] = put_all(store, blocks)
    store.close()
    # used before: the same store again, its blocks dropped
    store = new_store(capacity, blocks[0])
    put_all(store, blocks)
    for i in range(len(blocks)):
        store.remove(key(i))
    seconds["used before"] = put_all(store, blocks)
    store.close()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=256, help="blocks per put run")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    blocks = [rng.integers(0, 255, BLOCK, dtype=np.uint8).data for _ in range(args.blocks)]
    capacity = (args.blocks + 2) * BLOCK
    prefault.AHEAD_BYTES = capacity  # the whole run ahead (the node keeps 128 MB ahead)
    rounds = [one_round(blocks, capacity) for _ in range(args.rounds)]
    mb = args.blocks * BLOCK / 1e6
    print(f"CPU flags: {' '.join(cpu_flags())}")
    print(f"{args.blocks} blocks of {BLOCK:,} B ({mb:.0f} MB), {args.rounds} rounds, medians\n")
    print("| side | ms per block | GB/s | vs fresh |")
    print("|---|---:|---:|---:|")
    fresh = statistics.median(r["fresh"] for r in rounds)
    for side in ("fresh", "faulted in ahead", "used before"):
        s = statistics.median(r[side] for r in rounds)
        print(f"| {side} | {s / args.blocks * 1e3:.3f} | {mb / 1e3 / s:.2f} | {fresh / s:.2f}x |")
    s = statistics.median(r["prefault itself"] for r in rounds)
    print(f"\nFaulting the {mb:.0f} MB in ahead took {s * 1e3:.0f} ms ({mb / 1e3 / s:.2f} GB/s).")


if __name__ == "__main__":
    main()
