"""Tracing overhead: the same stack with spans exported over OTLP vs tracing off.

Two identical stacks (1 prefill + 1 decode node each) run side by side; they take turns
serving the same burst of concurrent requests (A B B A ...), so machine noise falls on both.
Stack A exports every span to a real OTLP/HTTP receiver in this process.

    python benchmarks/tracing.py [--rounds 6] [--concurrency 16] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.bus.server import free_port
from shared.model.source import DEFAULT_MODEL
from tandem.cli import build_parser
from tandem.launcher import Stack
from tests.otlp_receiver import OtlpReceiver

MODEL = DEFAULT_MODEL


def make_stack(otlp: str | None, log: Path) -> Stack:
    argv = ["up", "--prefill", "1", "--decode", "1", "--kvcache", "0", "--threads", "1"]
    argv += ["--port", str(free_port()), "--transport", "ucx", "--kv-cache-mb", "256"]
    if otlp:
        argv += ["--otlp-endpoint", otlp]
    stack = Stack(build_parser().parse_args(argv))
    stack.out = log.open("w")
    stack.start()
    return stack


async def burst(url: str, concurrency: int, max_tokens: int) -> tuple[float, int]:
    body = {
        "model": MODEL,
        "prompt": "Write a short story about a lighthouse keeper and a storm.",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    async with aiohttp.ClientSession() as session:

        async def one() -> int:
            async with session.post(url + "/v1/completions", json=body) as resp:
                data = await resp.json()
                return int(data["usage"]["completion_tokens"])

        start = time.perf_counter()
        tokens = await asyncio.gather(*(one() for _ in range(concurrency)))
        return time.perf_counter() - start, sum(tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    receiver = OtlpReceiver()
    receiver.start()
    logs = Path("bench-results")
    logs.mkdir(exist_ok=True)
    stacks = {
        "tracing exported (OTLP)": make_stack(receiver.url, logs / "tracing-on.log"),
        "tracing off": make_stack(None, logs / "tracing-off.log"),
    }
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in stacks}
    try:
        for stack in stacks.values():
            stack.wait_ready()
            asyncio.run(burst(stack.url, 4, 4))  # warm-up
        names = list(stacks)
        for r in range(args.rounds):
            order = names if r % 2 == 0 else names[::-1]
            for name in order:
                elapsed, tokens = asyncio.run(
                    burst(stacks[name].url, args.concurrency, args.max_tokens)
                )
                results[name].append((args.concurrency / elapsed, tokens / elapsed))
                print(f"  round {r + 1} {name}: {tokens / elapsed:.1f} tokens/s", flush=True)
    finally:
        for stack in stacks.values():
            stack.stop()
        receiver.stop()
    off = results["tracing off"]
    base_rps = statistics.median(v[0] for v in off)
    base_tps = statistics.median(v[1] for v in off)
    print()
    print("| configuration | requests/s | tokens/s | × off (tokens/s) |")
    print("|---|---:|---:|---:|")
    for name, vals in results.items():
        rps = statistics.median(v[0] for v in vals)
        tps = statistics.median(v[1] for v in vals)
        print(f"| {name} | {rps:.2f} | {tps:.1f} | {tps / base_tps:.3f} |")
    print(f"\nspans received: {len(receiver.snapshot())}; requests/s off: {base_rps:.2f}")


if __name__ == "__main__":
    main()
