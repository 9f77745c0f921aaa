"""Nodes SIGKILLed mid-request: the requests complete elsewhere, no gap, no repeat.

The same requests first run uninterrupted (the reference), then again with decode-1 killed
once every stream has tokens; each client-side text must equal the reference exactly. The
killed node is restarted afterwards so the package's stack stays whole for other tests.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.model.loader import LoadedModel
from tandem.launcher import Stack
from tests.e2e.conftest import wait_for_every_node
from tests.e2e.test_api import MODEL, reference, text_of

pytestmark = pytest.mark.e2e

PROMPTS = [
    "Write a long story about a lighthouse keeper.",
    "List the planets of the solar system and describe each one.",
    "Explain how a steam engine works, step by step.",
    "Describe a walk through a forest in autumn.",
]
MAX_TOKENS = 80


def router_metric(stack: Stack, name: str, **labels: str) -> float:
    with urllib.request.urlopen(stack.url + "/metrics", timeout=5) as r:
        for family in text_string_to_metric_families(r.read().decode()):
            for s in family.samples:
                if s.name == name and labels.items() <= s.labels.items():
                    return float(s.value)
    return 0.0


def failovers(stack: Stack) -> float:
    return router_metric(stack, "tandem_failovers_total")


REFERENCE: list[str] = []  # the uninterrupted texts, computed once
GAPS: list[float] = []  # per stream: the longest wait for a chunk after the kill


async def run_all(stack: Stack, kill_after: int | None, signal: str = "kill") -> list[str]:
    c = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="-", max_retries=0, timeout=300)
    counts = [0] * len(PROMPTS)
    killed = asyncio.Event()
    killed_at = [0.0]

    async def one(i: int) -> str:
        stream = await c.completions.create(
            model=MODEL,
            prompt=PROMPTS[i],
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        parts = []
        last = time.monotonic()
        gap = 0.0
        async for chunk in stream:
            now = time.monotonic()
            if killed.is_set() and now >= killed_at[0]:
                gap = max(gap, now - max(last, killed_at[0]))
            last = now
            parts.append(chunk.choices[0].text if chunk.choices else "")
            counts[i] += 1
            if kill_after is not None and not killed.is_set() and min(counts) >= kill_after:
                killed.set()
                killed_at[0] = time.monotonic()
                stop = stack.kill if signal == "kill" else stack.terminate
                await asyncio.to_thread(stop, "decode-1")
        if killed.is_set():
            GAPS.append(gap)
        return "".join(parts)

    try:
        return list(await asyncio.gather(*(one(i) for i in range(len(PROMPTS)))))
    finally:
        await c.close()


async def test_decode_node_killed_mid_stream_resumes_exactly(stack: Stack) -> None:
    reference = await run_all(stack, kill_after=None)
    REFERENCE[:] = reference
    before = failovers(stack)
    probed = router_metric(stack, "tandem_errors_total", type="node_unresponsive")
    started = time.monotonic()
    GAPS.clear()
    try:
        resumed = await run_all(stack, kill_after=12)
    finally:
        stack.restart("decode-1")
    assert resumed == reference  # no gap, no repeat, same tokens
    assert failovers(stack) - before >= 1  # decode-1 was serving some of them
    # Found dead by a probe of its quiet streams, not by waiting for its registry entry.
    assert router_metric(stack, "tandem_errors_total", type="node_unresponsive") > probed
    print(f"longest wait for a token after the kill, per stream: {sorted(GAPS)}")
    print(f"4 streams with a decode node killed finished in {time.monotonic() - started:.1f}s")
    await asyncio.to_thread(wait_for_every_node, stack, 300)
    for _ in range(100):  # the restarted node is back in the registry before others run
        with urllib.request.urlopen(stack.url + "/readyz", timeout=5) as r:
            if b'"decode": 2' in r.read():
                break
        await asyncio.sleep(0.2)


async def test_decode_node_stopped_gracefully_finishes_its_streams(stack: Stack) -> None:
    """SIGTERM: the node stops taking work, finishes what it runs, then exits cleanly."""
    reference = REFERENCE or await run_all(stack, kill_after=None)
    before = failovers(stack)
    served = {"name": "tandem_node_requests_total", "role": "decode", "node": "decode-1"}
    served_before = router_metric(stack, **served)
    try:
        drained = await run_all(stack, kill_after=12, signal="term")
        proc = stack.child("decode-1").proc
        assert proc is not None
        assert await asyncio.to_thread(proc.wait, 60) == 0
    finally:
        stack.restart("decode-1")
    assert drained == reference
    assert router_metric(stack, **served) > served_before  # decode-1 was serving some
    assert failovers(stack) == before  # finished where they ran: nothing was handed off
    await asyncio.to_thread(wait_for_every_node, stack, 300)
    for _ in range(100):
        with urllib.request.urlopen(stack.url + "/readyz", timeout=5) as r:
            if b'"decode": 2' in r.read():
                break
        await asyncio.sleep(0.2)


def queue_depth(stack: Stack, node: str) -> float:
    port = stack.metrics_ports[node]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for family in text_string_to_metric_families(r.read().decode()):
            for s in family.samples:
                if s.name == "tandem_prefill_queue_depth":
                    return float(s.value)
    return 0.0


async def test_prefill_node_killed_mid_prefill_its_job_completes_elsewhere(
    stack: Stack, real_model: LoadedModel
) -> None:
    """JetStream redelivers the dead node's unacked job (ack_wait; live nodes keep theirs
    with in_progress), another prefill node computes it, the tokens are the reference's."""
    words = ["orbit", "comet", "nebula", "quasar", "pulsar", "galaxy", "meteor", "aurora"]
    prompt = " ".join(words[(i * 5) % 8] for i in range(1200)) + " In summary,"
    ids = real_model.encode(prompt)
    ref = text_of(real_model, reference(real_model, ids, 12))
    c = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="-", max_retries=0, timeout=300)
    victim = None
    try:
        task = asyncio.create_task(
            c.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        )
        deadline = time.monotonic() + 60
        while victim is None and time.monotonic() < deadline and not task.done():
            for node in ("prefill-1", "prefill-2"):
                if await asyncio.to_thread(queue_depth, stack, node) > 0:
                    victim = node
                    break
            await asyncio.sleep(0.1)
        assert victim is not None, "no prefill node was seen holding the job"
        await asyncio.to_thread(stack.kill, victim)
        resp = await task
        assert resp.choices[0].text == ref
    finally:
        await c.close()
        if victim is not None:
            stack.restart(victim)
            await asyncio.to_thread(wait_for_every_node, stack, 300)
