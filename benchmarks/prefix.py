"""Prefix caching: time to first token with a cached prefix vs cold, and multi-turn chat.

Part 1, one stack (1 prefill + 1 decode + 1 kvcache node, 100 MiB of KV pool per node, so
two filler prompts evict everything): for each round, a fresh random 1,800-token prefix P.
  cold:          P + suffix A (2,000 tokens), nothing cached;
  kvcache hit:   P + suffix B after two filler prompts evicted P from the nodes' pools,
                 so the 1,800 tokens come from the kvcache service over the data plane;
  local hit:     P + suffix C right after, from the prefill node's own pool.
Part 2, two stacks side by side, with and without prefix caching (no kvcache service, no
reuse in the pools): the same multi-turn chats alternate between them (A B B A ...), each
turn resending the history. Medians over rounds; the TTFT target is cached <= 0.25x cold.

    python benchmarks/prefix.py [--rounds 5] [--chats 4] [--turns 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.bus.server import free_port
from tandem.cli import build_parser
from tandem.launcher import Stack

MODEL = "smollm2-135m-instruct"
WORDS = [
    "river",
    "stone",
    "cloud",
    "amber",
    "quiet",
    "north",
    "lantern",
    "orbit",
    "maple",
    "signal",
    "copper",
    "meadow",
]


def make_stack(log: Path, caching: bool) -> Stack:
    argv = ["up", "--prefill", "1", "--decode", "1", "--kvcache", "1" if caching else "0"]
    argv += ["--port", str(free_port()), "--transport", "ucx", "--kv-cache-mb", "100"]
    argv += ["--threads", "1"]
    stack = Stack(build_parser().parse_args(argv))
    if not caching:
        stack.env = {"TANDEM_NO_PREFIX_CACHING": "1", "TANDEM_NO_KVCACHE": "1"}
    stack.out = log.open("w")
    stack.start()
    return stack


def text_of_tokens(rng: random.Random, n: int) -> str:
    """About n tokens of text (these words are single tokens with their leading space)."""
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def stream(
    session: aiohttp.ClientSession, url: str, body: dict[str, object]
) -> tuple[float, str]:
    """(seconds to the first streamed chunk, the whole text) of one streamed request."""
    start = time.perf_counter()
    first = None
    text = []
    async with session.post(url, json={**body, "stream": True}) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            if first is None:
                first = time.perf_counter() - start
            choices = json.loads(line[6:]).get("choices") or [{}]
            text.append(choices[0].get("text") or choices[0].get("delta", {}).get("content") or "")
    assert first is not None
    return first, "".join(text)


async def ttft(session: aiohttp.ClientSession, url: str, body: dict[str, object]) -> float:
    return (await stream(session, url, body))[0]


async def part1(url: str, rounds: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"cold": [], "kvcache hit": [], "local hit": []}
    rng = random.Random(1)
    async with aiohttp.ClientSession() as s:
        completions = url + "/v1/completions"

        def body(prompt: str) -> dict[str, object]:
            return {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}

        await ttft(s, completions, body(text_of_tokens(rng, 50)))  # warm-up
        for r in range(rounds):
            prefix = text_of_tokens(rng, 1800)
            out["cold"].append(await ttft(s, completions, body(prefix + text_of_tokens(rng, 200))))
            for _ in range(2):  # two fillers push all of P out of both nodes' pools
                await ttft(s, completions, body(text_of_tokens(rng, 2000)))
            await asyncio.sleep(1.0)  # background uploads of P's blocks have landed
            out["kvcache hit"].append(
                await ttft(s, completions, body(prefix + text_of_tokens(rng, 200)))
            )
            out["local hit"].append(
                await ttft(s, completions, body(prefix + text_of_tokens(rng, 200)))
            )
            print(f"  round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in out.items()))
    return out


async def chat(url: str, seed: int, turns: int) -> tuple[float, list[float]]:
    """One conversation; (seconds in total, TTFT per turn)."""
    rng = random.Random(seed)
    messages = [{"role": "system", "content": text_of_tokens(rng, 300)}]
    ttfts = []
    start = time.perf_counter()
    async with aiohttp.ClientSession() as s:
        for _ in range(turns):
            messages.append({"role": "user", "content": text_of_tokens(rng, 60) + "?"})
            body = {"model": MODEL, "messages": messages, "max_tokens": 32, "temperature": 0}
            first, answer = await stream(s, url + "/v1/chat/completions", body)
            ttfts.append(first)
            messages.append({"role": "assistant", "content": answer})
    return time.perf_counter() - start, ttfts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chats", type=int, default=4)
    parser.add_argument("--turns", type=int, default=5)
    args = parser.parse_args()
    logs = Path("bench-results")
    logs.mkdir(exist_ok=True)
    stacks = {
        "prefix caching": make_stack(logs / "prefix-on.log", caching=True),
        "no prefix caching": make_stack(logs / "prefix-off.log", caching=False),
    }
    try:
        for stack in stacks.values():
            stack.wait_ready()
        print("part 1: TTFT of a 2,000-token prompt")
        p1 = asyncio.run(part1(stacks["prefix caching"].url, args.rounds))
        print("part 2: multi-turn chats")
        p2: dict[str, list[tuple[float, list[float]]]] = {k: [] for k in stacks}
        names = list(stacks)
        for c in range(args.chats):
            for name in names if c % 2 == 0 else names[::-1]:
                p2[name].append(asyncio.run(chat(stacks[name].url, c, args.turns)))
                print(f"  chat {c + 1} {name}: {p2[name][-1][0]:.1f}s", flush=True)
    finally:
        for stack in stacks.values():
            stack.stop()
    cold = statistics.median(p1["cold"])
    print("\n| 2,000-token prompt | median TTFT s | x cold |")
    print("|---|---:|---:|")
    for name, vals in p1.items():
        print(f"| {name} (1,800 cached)" if name != "cold" else "| cold", end="")
        print(f" | {statistics.median(vals):.3f} | {statistics.median(vals) / cold:.2f} |")
    base = statistics.median(t for t, _ in p2["no prefix caching"])
    print(
        f"\n| {args.turns}-turn chat | median s per chat | turns/s | median TTFT s (turns 2+) "
        "| x no caching (time) |"
    )
    print("|---|---:|---:|---:|---:|")
    for name, runs in p2.items():
        total = statistics.median(t for t, _ in runs)
        later = statistics.median(x for _, ts in runs for x in ts[1:])
        print(
            f"| {name} | {total:.2f} | {args.turns / total:.2f} | {later:.3f} "
            f"| {total / base:.2f} |"
        )


if __name__ == "__main__":
    main()
