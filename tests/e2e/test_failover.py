"""A decode node stopped gracefully (SIGTERM) mid-stream: it drains, nothing fails over.

(Nodes SIGKILLed mid-request — decode and prefill — are covered at scale by
test_chaos.py, across hosts by test_multihost.py.) The streams are prefixes of the chaos
workload, whose uninterrupted texts the package computes once; the stopped node is
restarted afterwards so the package's stack stays whole for other tests.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.engine.engine import Engine, EngineConfig
from shared.model.loader import LoadedModel
from shared.sampling_params import SamplingParams
from tandem.launcher import Stack
from tests.e2e.chaos import Request, Stream, run_streams
from tests.e2e.conftest import wait_for_every_node
from tests.e2e.netns_client import metric
from tests.e2e.streaming import registry

pytestmark = pytest.mark.e2e

STREAMS = 4
MAX_TOKENS = 80
STOP_AFTER = 12


def router_metric(stack: Stack, name: str, **labels: str) -> float:
    with urllib.request.urlopen(stack.url + "/metrics", timeout=5) as r:
        for family in text_string_to_metric_families(r.read().decode()):
            for s in family.samples:
                if s.name == name and labels.items() <= s.labels.items():
                    return float(s.value)
    return 0.0


def failovers(stack: Stack) -> float:
    return router_metric(stack, "tandem_failovers_total")


async def test_decode_node_stopped_gracefully_finishes_its_streams(
    stack: Stack, chaos_reference: tuple[list[Request], list[list[str]]]
) -> None:
    """SIGTERM: the node stops taking work, finishes what it runs, then exits cleanly."""
    requests, pieces = chaos_reference
    requests = [Request(r.prompt_ids, MAX_TOKENS) for r in requests[:STREAMS]]
    expected = ["".join(p[:MAX_TOKENS]) for p in pieces[:STREAMS]]
    streams = [Stream() for _ in requests]
    before = failovers(stack)
    served = {"name": "tandem_node_requests_total", "role": "decode", "node": "decode-1"}
    served_before = router_metric(stack, **served)

    async def stop() -> None:
        while min(s.events for s in streams) < STOP_AFTER:
            await asyncio.sleep(0.05)
        await asyncio.to_thread(stack.terminate, "decode-1")

    try:
        await asyncio.gather(run_streams(stack.url, requests, streams), stop())
        proc = stack.child("decode-1").proc
        assert proc is not None
        assert await asyncio.to_thread(proc.wait, 60) == 0
    finally:
        stack.restart("decode-1")
    assert [s.text for s in streams] == expected
    assert router_metric(stack, **served) > served_before  # decode-1 was serving some
    assert failovers(stack) == before  # finished where they ran: nothing was handed off
    await asyncio.to_thread(wait_for_every_node, stack, 300)
    for _ in range(100):
        with urllib.request.urlopen(stack.url + "/readyz", timeout=5) as r:
            if b'"decode": 2' in r.read():
                break
        await asyncio.sleep(0.2)


def logprobs_of(model: LoadedModel, request: Request) -> list[float]:
    """The uninterrupted run's token logprobs, from an in-process engine."""
    params = SamplingParams(
        max_tokens=request.max_tokens, temperature=0, ignore_eos=True, logprobs=request.logprobs
    )
    engine = Engine(model, EngineConfig(num_blocks=256))
    engine.add_request(request.prompt_ids, params)
    out = []
    while engine.has_unfinished():
        out += [lp.logprob for o in engine.step() for lp in o.logprobs or []]
    return out


def node_metric(stack: Stack, node: str, name: str) -> float:
    return metric(str(stack.metrics_ports[node]), name)


async def test_a_decode_node_killed_resumes_on_its_standby_which_loaded_the_context_first(
    stack: Stack, chaos_reference: tuple[list[Request], list[list[str]]], real_model: LoadedModel
) -> None:
    """A stream past `--standby-after` tokens has a standby: the other decode node loads the
    stream's stored KV ahead of any failure. SIGKILL the stream's node: it resumes on the
    standby, which loads only the blocks stored since (not the whole context), and the text
    equals the uninterrupted run; so do the logprobs it asked for, one per token."""
    requests, pieces = chaos_reference
    i = max(range(len(requests)), key=lambda j: len(requests[j].prompt_ids))  # ~300 tokens
    request, expected = Request(requests[i].prompt_ids, 96, logprobs=1), "".join(pieces[i][:96])
    context_blocks = len(request.prompt_ids) // 16
    decode = ["decode-1", "decode-2"]
    loaded, prefetched = "tandem_prefix_cache_loaded_blocks", "tandem_standby_prefetched_blocks"
    prefetched_before = {n: node_metric(stack, n, prefetched) for n in decode}
    stream = Stream()
    victim = standby = ""
    loaded_before = 0.0

    async def kill() -> None:
        nonlocal victim, standby, loaded_before
        while stream.events < 24:  # past the standby's 16 tokens
            await asyncio.sleep(0.02)
        for _ in range(200):  # the standby loaded the prompt's blocks
            grew = {n: node_metric(stack, n, prefetched) - prefetched_before[n] for n in decode}
            if max(grew.values()) >= context_blocks:
                break
            await asyncio.sleep(0.05)
        standby = max(decode, key=lambda n: grew[n])
        assert grew[standby] >= context_blocks, grew
        victim = next(n for n in decode if n != standby)
        loaded_before = node_metric(stack, standby, loaded)
        await asyncio.to_thread(stack.kill, victim)

    try:
        await asyncio.gather(run_streams(stack.url, [request], [stream]), kill())
        assert stream.text == expected
        assert stream.logprobs == pytest.approx(logprobs_of(real_model, request), abs=1e-4)
        # The resume loaded what was stored after the prefetch: a few blocks of generated
        # tokens at most (the context is ~20 blocks); the tail came on its own.
        assert node_metric(stack, standby, loaded) - loaded_before <= 6
        assert router_metric(stack, "tandem_failovers_total") >= 1
    finally:
        if victim:
            stack.restart(victim)
    await asyncio.to_thread(wait_for_every_node, stack, 300)


async def test_a_decode_node_lost_with_the_kvcache_node_holding_its_checkpoints(
    stack: Stack, chaos_reference: tuple[list[Request], list[list[str]]]
) -> None:
    """A fault case of issue 49: a decode node and kvcache-1 SIGKILLed together mid-stream.
    The checkpoints and tails went with the kvcache node, so the dead node's streams resume
    on the other by recomputing their context (or from a standby's prefetched KV), and every
    stream still ends exactly as uninterrupted; the stack serves on without a kvcache node."""
    requests, pieces = chaos_reference
    requests = [Request(r.prompt_ids, 64) for r in requests[STREAMS : STREAMS + 6]]
    expected = ["".join(p[:64]) for p in pieces[STREAMS : STREAMS + 6]]
    streams = [Stream() for _ in requests]
    before = failovers(stack)
    victim: list[str] = []

    async def kill() -> None:
        while min(s.events for s in streams) < 20:  # past a checkpoint's 16 tokens
            await asyncio.sleep(0.05)
        # the decode node running the most of them (a clean-clone run had placed all six
        # on decode-2, and killing decode-1 failed nothing over)
        since, busy = time.time(), {}
        while not busy:
            busy = {n: r for n, (r, _) in (await registry(stack, since)).items() if r > 0}
            await asyncio.sleep(0.05)
        victim.append(max(busy, key=lambda n: busy[n]))
        await asyncio.to_thread(stack.kill, "kvcache-1")
        await asyncio.to_thread(stack.kill, victim[0])

    try:
        await asyncio.gather(run_streams(stack.url, requests, streams), kill())
        assert [s.text for s in streams] == expected  # no gap, no repeat
        assert failovers(stack) > before  # the victim had some of them
    finally:
        stack.restart("kvcache-1")
        if victim:
            stack.restart(victim[0])
        await asyncio.to_thread(wait_for_every_node, stack, 300)
