"""What the chaos tests share: a varied streaming workload, its uninterrupted reference, a
client that records when every event arrived, and the report read from the stack's log.

The reference is the engine itself, in this process, on the same prompts (the same code
the nodes run, batched differently; the engine equals transformers' greedy generate in
tests/integration). Client texts must equal it exactly: no gap, no repeat, same tokens.
A copy is stored in the repository and reused where it still holds (reference_cache.py).
"""

from __future__ import annotations

import asyncio
import random
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from shared.engine.engine import Engine, EngineConfig
from shared.model.loader import LoadedModel
from shared.sampling_params import SamplingParams
from tests.e2e.streaming import stream_events

MODEL = "smollm2-135m-instruct"
WORDS = [
    "river", "mountain", "lantern", "harbour", "violin", "orchard", "glacier", "meadow",
    "compass", "ember", "falcon", "quarry", "saddle", "thistle", "beacon", "canyon",
    "prairie", "walrus", "tundra", "marble", "cobalt", "jasmine",
]  # fmt: skip
TOPICS = [
    "the history of the printing press", "how tides work", "a day in a busy bakery",
    "the life cycle of a star", "building a wooden boat", "why leaves change colour",
    "the rules of chess", "a journey on a night train",
]  # fmt: skip


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int
    logprobs: int | None = None  # ask for them (completions' `logprobs`)
    seed: int | None = None  # sampled (temperature 0.9, top-k 40) with this seed; else greedy


@dataclass
class Stream:
    """One client stream as seen by the client."""

    rid: str = ""
    texts: list[str] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # monotonic arrival per event
    logprobs: list[float] = field(default_factory=list)  # per token, if asked
    events: int = 0

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def gap_around(self, moment: float) -> float | None:
        """Last event before `moment` → first event after it (None if not both)."""
        before = [t for t in self.times if t <= moment]
        after = [t for t in self.times if t > moment]
        return after[0] - before[-1] if before and after else None


def workload(model: LoadedModel, n: int, min_tokens: int, seed: int = 7) -> list[Request]:
    """n prompts from ~10 to ~300 tokens, output lengths min_tokens to min_tokens + 8."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        filler = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(0, 220)))
        text = f"Write at length about {TOPICS[i % len(TOPICS)]}. {filler}"
        ids = model.tokenizer.encode(text, add_special_tokens=False)
        out.append(Request(ids, min_tokens + rng.randrange(0, 9)))
    return out


def chaos_requests(model: LoadedModel) -> list[Request]:
    """The chaos tests' 32 requests of >= 200 output tokens."""
    return workload(model, 32, 200)


def reference(model: LoadedModel, requests: list[Request]) -> list[list[str]]:
    """The uninterrupted runs as the text each token added (so a shorter request's text is
    a prefix's join), from one in-process engine running them all."""
    engine = Engine(model, EngineConfig(kv_cache_bytes=2 << 30))
    ids = [
        engine.add_request(
            r.prompt_ids, SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True)
        )
        for r in requests
    ]
    texts: dict[str, list[str]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.request_id].append(out.text)
    return [texts[rid] for rid in ids]


async def stream_one(
    session: aiohttp.ClientSession, url: str, request: Request, into: Stream
) -> None:
    body = {
        "model": MODEL,
        "prompt": request.prompt_ids,
        "max_tokens": request.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    if request.logprobs is not None:
        body["logprobs"] = request.logprobs
    if request.seed is not None:
        body.update(temperature=0.9, top_k=40, seed=request.seed)
    async for data in stream_events(session, url, body):
        into.rid = data["id"]
        into.times.append(time.monotonic())
        into.texts.append(data["choices"][0]["text"] if data["choices"] else "")
        logprobs = data["choices"][0].get("logprobs") if data["choices"] else None
        if logprobs:
            into.logprobs.extend(logprobs["token_logprobs"])
        into.events += 1


async def run_streams(
    url: str,
    requests: list[Request],
    streams: list[Stream],
    later: int = 0,
    go: asyncio.Event | None = None,
) -> None:
    """Run every stream; the last `later` of them start once `go` is set."""
    timeout = aiohttp.ClientTimeout(total=900)
    now = len(requests) - later
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def second_wave() -> None:
            if later:
                assert go is not None
                await go.wait()
                pairs = zip(requests[now:], streams[now:], strict=True)
                await asyncio.gather(*(stream_one(session, url, r, s) for r, s in pairs))

        pairs = zip(requests[:now], streams[:now], strict=True)
        await asyncio.gather(*(stream_one(session, url, r, s) for r, s in pairs), second_wave())


FAILOVER = re.compile(r"((?:chat)?cmpl-[0-9a-f]{24}): .*?resuming after (\d+) delivered tokens")
RECOMPUTED = re.compile(r"resumed ((?:chat)?cmpl-[0-9a-f]{24}) after \d+ tokens: (\d+) of (\d+)")


def failed_over(log: Path) -> set[str]:
    """Request ids the router resumed on another node (from its log)."""
    return {m.group(1) for m in FAILOVER.finditer(log.read_text(errors="replace"))}


def recomputed_tokens(log: Path) -> list[int]:
    """Per resume (a prefill node's, or a decode node's resuming locally): the context
    tokens it recomputed (from the stack's log)."""
    return [recomputed for recomputed, _ in resumes(log)]


def resumes(log: Path) -> list[tuple[int, int]]:
    """Per resume, as `recomputed_tokens`: (context tokens recomputed, context tokens)."""
    text = log.read_text(errors="replace")
    return [(int(m.group(2)), int(m.group(3))) for m in RECOMPUTED.finditer(text)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def report(title: str, recoveries: list[float], recomputed: list[int]) -> str:
    lines = [title]
    if recoveries:
        lines.append(
            f"  recovery (last token before the failure -> next after) over "
            f"{len(recoveries)} failed-over streams: p50 {statistics.median(recoveries):.2f}s "
            f"p99 {percentile(recoveries, 0.99):.2f}s max {max(recoveries):.2f}s"
        )
    if recomputed:
        lines.append(
            f"  recomputed tokens per resume over {len(recomputed)} resumes: "
            f"p50 {statistics.median(recomputed):.0f} max {max(recomputed)}"
        )
    return "\n".join(lines)
