"""Failover: recovery time and recomputed tokens, checkpointed resume vs full recompute;
and what checkpointing costs a decode node.

Stacks side by side (1 prefill, 2 decode; the same UCX data plane), used in turn:
  checkpointed:  decode nodes store every KV block they fill in the kvcache service, and
                 every 0.25 s each sequence's partly filled last block, so a resume loads
                 the prompt's and the generated tokens' KV and recomputes only the tokens
                 since that; after 16 tokens the other decode node, the stream's standby,
                 loads the KV stored so far, and a resume there loads the rest;
  paced:         the same with the checkpoint uploads paced to 50 MB/s
                 (--checkpoint-rate 50; unpaced by default);
  everystep:     the same with the partial blocks stored after every step
                 (--checkpoint-tail-interval 0): a resume recomputes one token;
  nostandby:     the same without a standby (router --standby-after 0): a resume loads
                 the whole context from the kvcache service;
  blocks:        the same without the partial blocks (--no-checkpoint-tails): a resume
                 recomputes the tokens after the last full block;
  nocheckpoints: a kvcache service and prefix reuse, no checkpoints (--checkpoint-every
                 0): the baseline of part 2 when it runs (else recompute);
  recompute:     no kvcache service and no prefix reuse: a resume recomputes the prompt
                 and every generated token.
Part 1, for prompts of 512 and 2,048 tokens: one greedy stream of 64 tokens; after 32 the
decode node serving it is SIGKILLed. Recovery = the client's wait between the last token
before the kill and the next one; recomputed tokens = the context tokens the node that
resumed it (a decode node, or a prefill node when it refused) computed rather than loaded
(`tandem_resume_recomputed_tokens`). The killed node is restarted between rounds.
Part 2: decode throughput, 8 streams x 128 tokens, checkpoint uploads on vs off (tokens per
second while all 8 decode), and the CPU seconds each process used. Each round has new
prompts, the same for every stack, and runs every stack once (the order reversed every
other round).

    python benchmarks/failover.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.bus.server import free_port
from tandem.cli import build_parser
from tandem.launcher import Stack

MODEL = "smollm2-135m-instruct"
WORDS = ["river", "stone", "cloud", "amber", "quiet", "north", "lantern", "orbit", "maple"]
KILL_AFTER = 32
MODES = {  # part 2's row label for each
    "checkpointed": "checkpoint uploads on",
    "paced": "on, uploads paced to 50 MB/s",
    "everystep": "on, partial blocks every step",
    "nostandby": "on, no standby",
    "blocks": "on, full blocks only",
    "nocheckpoints": "off (kvcache and prefix reuse on)",
    "recompute": "off, no kvcache",
}
TOKENS = 64


def make_stack(log: Path, mode: str) -> Stack:
    checkpoints = mode != "recompute"
    argv = ["up", "--prefill", "1", "--decode", "2", "--kvcache", "1" if checkpoints else "0"]
    argv += ["--port", str(free_port()), "--transport", "ucx", "--kv-cache-mb", "200"]
    argv += ["--threads", "1", "--heartbeat-ttl", "2"]
    stack = Stack(build_parser().parse_args(argv))
    if not checkpoints:
        stack.env = {"TANDEM_NO_PREFIX_CACHING": "1", "TANDEM_NO_KVCACHE": "1"}
    else:
        stack.env = {
            "paced": {"TANDEM_CHECKPOINT_RATE": "50"},
            "everystep": {"TANDEM_CHECKPOINT_TAIL_INTERVAL": "0"},
            "blocks": {"TANDEM_NO_CHECKPOINT_TAILS": "1"},
            "nostandby": {"TANDEM_STANDBY_AFTER": "0"},
            "nocheckpoints": {"TANDEM_CHECKPOINT_EVERY": "0"},
        }.get(mode, {})
    stack.out = log.open("w")
    stack.start()
    return stack


def node_metric(stack: Stack, node: str, name: str) -> float:
    url = f"http://127.0.0.1:{stack.metrics_ports[node]}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        for family in text_string_to_metric_families(r.read().decode()):
            for s in family.samples:
                if s.name == name:
                    return float(s.value)
    return 0.0


def serving_decode(stack: Stack) -> str:
    for name in ("decode-1", "decode-2"):
        if node_metric(stack, name, "tandem_decode_running_sequences") > 0:
            return name
    raise RuntimeError("no decode node is running the stream")


def wait_for_node(stack: Stack, name: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            node_metric(stack, name, "tandem_kv_blocks_free")
            with urllib.request.urlopen(stack.url + "/readyz", timeout=2) as r:
                if b'"decode": 2' in r.read():
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{name} did not come back")


async def one_failover(stack: Stack, prompt: str, prompt_tokens: int) -> tuple[float, float]:
    """(recovery seconds, recomputed tokens) for one stream whose decode node is killed.

    Tokens are timestamped as they arrive while another task finds the serving node and
    kills it, so recovery is the client's gap around the kill: from the last token the dead
    node sent to the first of the node that resumed it.
    """
    body = {"model": MODEL, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0}
    body |= {"stream": True, "ignore_eos": True}
    recomputed = "tandem_resume_recomputed_tokens_sum"  # on whichever node resumed it
    nodes = ["prefill-1", "decode-1", "decode-2"]
    arrivals: list[float] = []

    async def kill() -> tuple[str, float, float]:
        """(victim, recomputed tokens so far on the others, when it was dead)."""
        victim = await asyncio.to_thread(serving_decode, stack)
        nodes.remove(victim)
        before = sum(node_metric(stack, n, recomputed) for n in nodes)
        await asyncio.to_thread(stack.kill, victim)
        return victim, before, time.perf_counter()

    url = stack.url + "/v1/completions"
    killer: asyncio.Task[tuple[str, float, float]] | None = None
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if line.startswith(b"data: {"):
                arrivals.append(time.perf_counter())
                if len(arrivals) == KILL_AFTER:
                    killer = asyncio.create_task(kill())
    assert killer is not None and len(arrivals) == TOKENS, f"{len(arrivals)} tokens streamed"
    victim, before, at = await killer
    # The widest gap between tokens that ends after the death (a delta still in flight
    # when the node died may arrive just after it: the gap is the one after that).
    recovery = max(b - a for a, b in itertools.pairwise(arrivals) if b > at)
    after = sum(node_metric(stack, n, recomputed) for n in nodes)
    stack.restart(victim)
    await asyncio.to_thread(wait_for_node, stack, victim)
    return recovery, after - before


def cpu_seconds(stack: Stack) -> dict[str, float]:
    """CPU time each of the stack's processes has used so far (user + system)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for child in stack.children:
        if child.proc is not None and child.proc.poll() is None:
            with open(f"/proc/{child.proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[child.name] = (int(fields[11]) + int(fields[12])) / tick
    return out


async def throughput(stack: Stack, cpu: dict[str, list[float]], seed: int) -> float:
    """Decode tokens per second of 8 concurrent 128-token streams while all 8 decode: from
    the last stream's first token to the first stream's last (prefill, queueing and the
    streams' ragged ends stay out of it); appends the CPU seconds each process used over
    the whole run to `cpu`. Prompts come from `seed`: new ones each round (a stack that
    kept a round's prompts cached would skip their prefill next round and route them by
    where they live, not by load), the same for every stack in a round."""
    body = {"model": MODEL, "max_tokens": 128, "temperature": 0, "ignore_eos": True}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    rng = random.Random(seed)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(100)) for _ in range(8)]
    async with aiohttp.ClientSession() as s:

        async def one(prompt: str) -> list[float]:
            """When each chunk with text arrived (a chunk is a token, except where a token
            ends mid-character and the next one carries it)."""
            arrivals, usage = [], None
            async with s.post(stack.url + "/v1/completions", json=body | {"prompt": prompt}) as r:
                r.raise_for_status()
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        chunk = json.loads(line[6:])
                        if chunk["choices"]:
                            arrivals.append(time.perf_counter())
                        usage = chunk.get("usage") or usage
            assert usage and usage["completion_tokens"] == 128, f"usage {usage}"
            return arrivals

        used = cpu_seconds(stack)
        streams = await asyncio.gather(*(one(p) for p in prompts))
        for name, seconds in cpu_seconds(stack).items():
            cpu.setdefault(name, []).append(seconds - used.get(name, seconds))
    start, end = max(t[0] for t in streams), min(t[-1] for t in streams)
    return sum(start < x <= end for t in streams for x in t) / (end - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--sizes", type=int, nargs="*", default=[512, 2048],
        help="prompt tokens (none: part 2 only)",
    )  # fmt: skip
    parser.add_argument(
        "--modes", nargs="+", choices=list(MODES),
        default=["checkpointed", "recompute"], help="stacks to start",
    )  # fmt: skip
    parser.add_argument("--no-throughput", action="store_true", help="skip part 2")
    args = parser.parse_args()
    logs = Path("bench-results")
    logs.mkdir(exist_ok=True)
    stacks = {name: make_stack(logs / f"failover-{name}.log", name) for name in args.modes}
    rng = random.Random(1)
    part1: dict[tuple[str, int], list[tuple[float, float]]] = {}
    part2: dict[str, list[float]] = {name: [] for name in stacks}
    cpu: dict[str, dict[str, list[float]]] = {name: {} for name in stacks}
    try:
        for stack in stacks.values():
            stack.wait_ready()
            for name in ("decode-1", "decode-2"):
                wait_for_node(stack, name)
        for size in args.sizes:
            for r in range(args.rounds):
                prompt = " ".join(rng.choice(WORDS) for _ in range(size))
                order = list(stacks) if r % 2 == 0 else list(stacks)[::-1]
                for name in order:
                    got = asyncio.run(one_failover(stacks[name], prompt, size))
                    part1.setdefault((name, size), []).append(got)
                    print(f"  {size} tokens, {name}: recovery {got[0]:.2f}s, "
                          f"recomputed {got[1]:.0f} tokens", flush=True)  # fmt: skip
        for r in range(0 if args.no_throughput else args.rounds):
            for name in list(stacks) if r % 2 == 0 else list(stacks)[::-1]:
                part2[name].append(asyncio.run(throughput(stacks[name], cpu[name], 1000 + r)))
                print(f"  throughput {name}: {part2[name][-1]:.1f} tokens/s", flush=True)
    finally:
        for stack in stacks.values():
            stack.stop()
    if part1:
        print("\n| prompt | mode | recovery p50 s | recovery max s | recomputed tokens p50 |")
        print("|---:|---|---:|---:|---:|")
    for (name, size), runs in sorted(part1.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        rec = [x for x, _ in runs]
        print(f"| {size} | {name} | {statistics.median(rec):.2f} | {max(rec):.2f} "
              f"| {statistics.median(t for _, t in runs):.0f} |")  # fmt: skip
    base = next((name for name in ("nocheckpoints", "recompute") if part2.get(name)), None)
    if base is None or len(part2) < 2:
        return
    off = statistics.median(part2[base])
    # The machine drifts by more than the overhead over a run; a round's stacks run one
    # after another, so the median of per-round ratios to the baseline is the steadier view.
    print(f"\n| decode, 8 streams decoding | per round tokens/s | median | overhead vs {base} "
          "| per-round overhead, median |")  # fmt: skip
    print("|---|---|---:|---:|---:|")
    for name, label in MODES.items():
        if part2.get(name):
            rate = statistics.median(part2[name])
            each = " ".join(f"{x:.1f}" for x in part2[name])
            paired = statistics.median(
                1 - x / y for x, y in zip(part2[name], part2[base], strict=True)
            )
            print(f"| {label} | {each} | {rate:.1f} | {(1 - rate / off) * 100:.1f}% "
                  f"| {paired * 100:.1f}% |")  # fmt: skip
    print("\n| mode | CPU seconds per run, median (per process) |")
    print("|---|---|")
    for name, used in cpu.items():
        each = ", ".join(f"{n} {statistics.median(v):.1f}" for n, v in sorted(used.items()))
        print(f"| {name} | {each} |")


if __name__ == "__main__":
    main()
