"""Several models in one cluster (issue 27): `tandem up --model A --model NAME=DIR` starts
each model's own prefill and decode nodes; the router lists both, routes each request to
its model's nodes (jobs on the model's own queue), and every answer is its model's."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.bus.client import Bus
from shared.bus.ids import AttemptId
from shared.bus.messages import (
    DecodeAssignment,
    PrefillJob,
    SequenceSnapshot,
    encode,
    read_reply,
)
from shared.bus.registry import NodeRegistry
from shared.bus.server import free_port
from shared.bus.topology import assign_subject, local_prefill_subject, token_subject
from shared.kv.block_hash import block_hashes
from shared.kvclient.client import KVCacheClient
from shared.model.loader import LoadedModel
from shared.model.runner import kv_layout
from shared.sampling_params import SamplingParams
from shared.transport.factory import make_transport
from shared.transport.pending import PendingTransfers
from tandem.launcher import Stack
from tests.e2e.conftest import running_stack, wait_for_every_node
from tests.e2e.streaming import MODEL, complete
from tests.e2e.test_api import reference, text_of
from tests.kv_peer import register_peer

TINY = "tiny-random"  # a 2-layer random Llama: other layers, heads and KV layout


async def a_node_refuses_another_models_work(stack: Stack) -> None:
    """The tiny model's decode node, asked to take SmolLM2's KV or to prefill a SmolLM2
    job, refuses both: its engine could not compute them."""
    bus = await Bus(stack.nats_url, "model-check", stack.auth).connect()
    try:
        nodes = (await (await NodeRegistry(bus).start()).nodes()).values()
        tiny = next(n for n in nodes if n.role == "decode" and n.model == TINY)
        assert {n.model for n in nodes if n.role in ("prefill", "decode")} == {MODEL, TINY}
        attempt = AttemptId("cmpl-wrong-model")
        snap = SequenceSnapshot(attempt, [1, 2, 3], [], SamplingParams(max_tokens=2, seed=0), 3)
        assign = DecodeAssignment(
            transfer_id="t-wrong-model",
            snapshot=snap,
            token_subject=token_subject(attempt),
            deadline=time.time() + 30,
            model=MODEL,
        )
        job = PrefillJob(
            attempt_id=attempt,
            prompt_ids=[1, 2, 3],
            params=SamplingParams(max_tokens=2),
            decode_node=tiny.node_id,
            token_subject=token_subject(attempt),
            deadline=time.time() + 30,
            model=MODEL,
        )
        assert bus.nc is not None
        for subject, msg in (
            (assign_subject(tiny.node_id), assign),
            (local_prefill_subject(tiny.node_id), job),
        ):
            reply = read_reply((await bus.nc.request(subject, encode(msg), timeout=10)).data)
            assert not reply.accepted and TINY in reply.reason, (subject, reply)
    finally:
        await bus.close()


async def stored_prefix(
    stack: Stack, model: LoadedModel, name: str, ids: list[int]
) -> list[memoryview]:
    """The blocks of `ids` the kvcache service holds for `model` (served as `name`), named
    as its nodes name them (block hashes keyed by model and dtype)."""
    layout = kv_layout(model, 16)
    hashes = block_hashes(ids, 16, f"{name}/{layout.dtype}".encode())
    bus = await Bus(stack.nats_url, "e2e-kv-check", stack.auth).connect()
    transport, pending = make_transport("tcp"), PendingTransfers()
    await transport.start(pending)
    peer = await register_peer(bus, transport, "e2e-kv-check")  # kvcache sends to nodes only
    try:
        client = KVCacheClient(bus, transport, pending, await NodeRegistry(bus).start())
        blocks = await client.load_prefix(hashes, layout.bytes_per_block)
        assert all(len(b) == layout.bytes_per_block for b in blocks)
        return blocks
    finally:
        await peer.remove("decode", "e2e-kv-check")
        await transport.close()
        await bus.close()


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3,"]


def sixteen_mixed_streams_are_exact(
    stack: Stack, real_model: LoadedModel, tiny_model: LoadedModel
) -> list[list[int]]:
    """16 concurrent streams, SmolLM2 and the tiny model alternating: each answer equals
    its model's `transformers` greedy output. The prompts' ids, in order."""
    requests = [
        (real_model if i % 2 == 0 else tiny_model, PROMPTS[i % len(PROMPTS)] + " " * (i // 8))
        for i in range(16)
    ]
    ids = [model.tokenizer.encode(prompt) for model, prompt in requests]

    async def run() -> list[str]:
        async with aiohttp.ClientSession() as session:
            return list(
                await asyncio.gather(
                    *(
                        complete(
                            session,
                            stack.url,
                            prompt_ids,
                            8,
                            {"model": MODEL if model is real_model else TINY},
                        )
                        for (model, _), prompt_ids in zip(requests, ids, strict=True)
                    )
                )
            )

    got = asyncio.run(run())
    for (model, prompt), prompt_ids, text in zip(requests, ids, got, strict=True):
        want = text_of(model, reference(model, prompt_ids, 8))
        assert text == want, (prompt, "tiny" if model is tiny_model else MODEL)
    return ids


@pytest.fixture(scope="module")
def two_models(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Stack]:
    """SmolLM2 and the tiny model, each with a prefill node and two decode nodes."""
    argv = [
        "--model", MODEL,
        "--model", f"{TINY}={tiny_model_dir}",
        "--prefill", "1",
        "--decode", "2",
        "--kvcache", "1",  # shared by both models' KV layouts
        "--transport", "tcp",
        "--kv-cache-mb", "128",
        "--heartbeat-ttl", "2",
        "--port", str(free_port()),
    ]  # fmt: skip
    log = tmp_path_factory.mktemp("two-models") / "stack.log"
    with running_stack(argv, log) as stack:
        wait_for_every_node(stack, timeout=300)
        yield stack


def test_two_models_in_one_cluster_each_answer_is_its_models(
    two_models: Stack, real_model: LoadedModel, tiny_model: LoadedModel
) -> None:
    stack = two_models
    with urllib.request.urlopen(stack.url + "/v1/models", timeout=10) as r:
        listed = [m["id"] for m in json.load(r)["data"]]
    assert listed == [MODEL, TINY]
    unknown = json.dumps({"model": "nope", "prompt": "x", "max_tokens": 1}).encode()
    try:
        urllib.request.urlopen(
            urllib.request.Request(
                stack.url + "/v1/completions",
                unknown,
                {"Content-Type": "application/json"},
            ),
            timeout=10,
        )
        raise AssertionError("an unknown model was served")
    except urllib.error.HTTPError as exc:
        assert exc.code == 404
        assert json.load(exc)["error"]["code"] == "model_not_found"

    ids = sixteen_mixed_streams_are_exact(stack, real_model, tiny_model)
    # the router's latency metrics are per model
    with urllib.request.urlopen(stack.url + "/metrics", timeout=10) as r:
        counts = {
            s.labels.get("model"): s.value
            for family in text_string_to_metric_families(r.read().decode())
            for s in family.samples
            if s.name == "tandem_time_to_first_token_seconds_count"
        }
    assert counts == {MODEL: 8, TINY: 8}
    asyncio.run(a_node_refuses_another_models_work(stack))
    # both models' blocks are in the one kvcache node, each at its own KV layout's size
    models = [(real_model, MODEL), (tiny_model, TINY)]
    long_ids = [(m, name, m.tokenizer.encode(PROMPTS[0] * 8)) for m, name in models]
    assert kv_layout(real_model, 16).bytes_per_block != kv_layout(tiny_model, 16).bytes_per_block

    async def long_prompts() -> None:
        async with aiohttp.ClientSession() as session:
            for _, name, prompt_ids in long_ids:
                await complete(session, stack.url, prompt_ids, 4, {"model": name})

    asyncio.run(long_prompts())
    for m, name, prompt_ids in long_ids:
        deadline = time.monotonic() + 60  # stored in the background after the prefill
        while (found := len(asyncio.run(stored_prefix(stack, m, name, prompt_ids)))) < 2:
            assert time.monotonic() < deadline, f"{name}: {found} of its 2 blocks in the kvcache"
            time.sleep(0.5)
    # the two models answer differently: each request really ran on its own model
    assert text_of(real_model, reference(real_model, ids[0], 8)) != text_of(
        tiny_model, reference(tiny_model, ids[0], 8)
    )


async def busy_decode_nodes(stack: Stack) -> dict[str, str]:
    """Model -> the one decode node of it running sequences (a model with none, or with
    more than one such node, is left out)."""
    bus = await Bus(stack.nats_url, "e2e-models", stack.auth).connect()
    try:
        nodes = (await (await NodeRegistry(bus).start()).nodes()).values()
    finally:
        await bus.close()
    busy: dict[str, list[str]] = {}
    for n in nodes:
        if n.role == "decode" and n.running > 0:
            busy.setdefault(n.model, []).append(n.node_id)
    return {model: ids[0] for model, ids in busy.items() if len(ids) == 1}


def test_a_stream_whose_decode_node_dies_resumes_on_a_node_of_its_model(
    two_models: Stack, real_model: LoadedModel, tiny_model: LoadedModel
) -> None:
    """One stream of each model; both decode nodes serving them are SIGKILLed mid-stream;
    each stream completes, identical to its model's reference, on its model's other node
    (a node of the other model would refuse it, and would compute other tokens)."""
    stack = two_models
    # (the tiny model steps far faster: its stream is longer, so both are under way at once)
    runs = [(real_model, MODEL, 48), (tiny_model, TINY, 400)]
    ids = [model.tokenizer.encode("Once upon a time, in a land far away,") for model, _, _ in runs]
    events: list[list[str]] = [[], []]

    async def run() -> tuple[list[str], dict[str, str]]:
        async with aiohttp.ClientSession() as session:
            streams = [
                asyncio.create_task(
                    complete(session, stack.url, prompt, n, {"model": name}, events[i])
                )
                for i, ((_, name, n), prompt) in enumerate(zip(runs, ids, strict=True))
            ]
            victims: dict[str, str] = {}

            async def both_a_few_tokens_in() -> bool:
                victims.update(await busy_decode_nodes(stack))
                return len(victims) == 2 and min(len(e) for e in events) >= 6

            deadline = time.monotonic() + 120
            while not await both_a_few_tokens_in():
                assert time.monotonic() < deadline, f"streams not under way: {victims}"
                await asyncio.sleep(0.1)
            for node in victims.values():
                await asyncio.to_thread(stack.kill, node)
            return list(await asyncio.gather(*streams)), victims

    got, victims = asyncio.run(run())
    assert set(victims) == {MODEL, TINY}
    for (model, name, n), prompt, text in zip(runs, ids, got, strict=True):
        assert text == text_of(model, reference(model, prompt, n)), name
