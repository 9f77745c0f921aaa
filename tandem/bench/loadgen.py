"""Arrival processes and the load loop: send requests on schedule, gather their timelines.

Open loop (`rate` set): send times are drawn up front — Poisson (exponential gaps) or
evenly spaced — so a slow server does not slow the arrivals, which is what makes queueing
show in TTFT. Closed loop (`rate` None) sends as fast as `concurrency` allows (all at once
without it). Both bounds stop new sends: the request count and `duration`; requests
already sent always finish (each within its own timeout), so every one sent is measured.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp

from shared.runtime.service import objects_frozen
from tandem.bench.client import request_body, send
from tandem.bench.metrics import RequestRecord
from tandem.bench.workload import RequestSpec


@dataclass(frozen=True)
class Target:
    url: str  # the server's base URL, e.g. http://127.0.0.1:8000
    model: str
    prompt_format: str = "tokens"  # tokens | text
    ignore_eos: bool = True
    api_key: str | None = None
    timeout: float = 300.0  # per request

    @property
    def completions_url(self) -> str:
        return self.url.rstrip("/") + "/v1/completions"


@dataclass(frozen=True)
class Load:
    rate: float | None  # requests/s; None: no pacing
    arrival: str = "poisson"  # poisson | constant
    concurrency: int | None = None  # cap on requests in flight
    duration: float | None = None  # stop sending after this many seconds


def arrival_times(n: int, rate: float | None, arrival: str, rng: random.Random) -> list[float]:
    """Send offsets (s) of n requests; the first goes at 0."""
    if rate is None:
        return [0.0] * n
    if rate <= 0:
        raise ValueError("request rate must be positive")
    if arrival == "constant":
        return [i / rate for i in range(n)]
    out, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out


def session(target: Target, limit: int) -> aiohttp.ClientSession:
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    # Timeouts are per request (asyncio.timeout in send); aiohttp's default total of 300 s
    # would cut long runs short. The pool is sized so the client never queues a request.
    return aiohttp.ClientSession(
        headers=headers,
        timeout=aiohttp.ClientTimeout(total=None),
        connector=aiohttp.TCPConnector(limit=max(1, limit)),
    )


class Progress:
    """tqdm on stderr (a dependency already); `quiet` turns it off."""

    def __init__(self, total: int, label: str, quiet: bool) -> None:
        from tqdm import tqdm

        self.bar = tqdm(
            total=total, desc=label, unit="req", file=sys.stderr, disable=quiet, leave=False
        )
        self.failed = 0

    def done(self, rec: RequestRecord) -> None:
        if rec.error is not None:
            self.failed += 1
            self.bar.set_postfix(failed=self.failed)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


async def run_load(
    target: Target,
    specs: list[RequestSpec],
    load: Load,
    seed: int = 0,
    on_done: Callable[[RequestRecord], None] | None = None,
    offsets: Sequence[float] | None = None,
) -> list[RequestRecord]:
    """Send `specs` per `load` (at the given `offsets` from the start instead, if any: a
    rate that changes over time); the records of every request sent, in send order."""
    if offsets is None:
        offsets = arrival_times(len(specs), load.rate, load.arrival, random.Random(seed))
    slots = asyncio.Semaphore(load.concurrency) if load.concurrency else None
    records: list[RequestRecord] = []
    tasks: list[asyncio.Task[RequestRecord]] = []
    start = 0.0  # set once the collection below is done

    def clock() -> float:
        return time.perf_counter() - start

    async def one(spec: RequestSpec, rec: RequestRecord) -> RequestRecord:
        try:
            body = request_body(spec, target.model, target.prompt_format, target.ignore_eos)
            await send(http, target.completions_url, body, rec, target.timeout, clock)
        finally:
            if slots is not None:
                slots.release()
        if on_done is not None:
            on_done(rec)
        return rec

    # the load generator's own full collections must not delay the chunks it times
    with objects_frozen():
        start = time.perf_counter()
        async with session(target, load.concurrency or len(specs)) as http:
            try:
                for spec, at in zip(specs, offsets, strict=True):
                    if load.duration is not None and max(at, clock()) >= load.duration:
                        break
                    if (delay := at - clock()) > 0:
                        await asyncio.sleep(delay)
                    if slots is not None:
                        await slots.acquire()  # closed loop: wait for a request to finish
                    rec = RequestRecord(
                        prompt_tokens=len(spec.prompt_ids), max_tokens=spec.max_tokens
                    )
                    records.append(rec)
                    tasks.append(asyncio.create_task(one(spec, rec)))
                await asyncio.gather(*tasks)
            finally:
                for task in tasks:  # interrupted: leave no request running
                    task.cancel()
    return records
