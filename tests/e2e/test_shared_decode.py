"""A decode pool shared across models (issue 27): `tandem up --model A --model B
--decode 2 --shared-decode` starts two decode processes, each hosting both models (one
engine per model on one engine thread, one KV budget), each model a node of its own in
the registry. Every answer is its model's; a load of both models makes the autoscaler
add a process hosting both, and drain it away after; a process hosting streams of both
models is SIGKILLed mid-stream, and every stream of both completes, identical, on the
other."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from shared.bus.client import Bus
from shared.bus.messages import NodeInfo
from shared.bus.registry import NodeRegistry
from shared.bus.server import free_port
from shared.engine.engine import Engine, EngineConfig
from shared.model.loader import LoadedModel
from shared.sampling_params import SamplingParams
from tandem.autoscale.controller import Controller
from tandem.autoscale.local_backend import LocalBackend
from tandem.autoscale.types import Decision, RoleBounds
from tandem.launcher import Stack
from tests.e2e.conftest import running_stack
from tests.e2e.streaming import MODEL, complete
from tests.e2e.test_api import text_of
from tests.e2e.test_autoscale import quick_policy
from tests.e2e.test_failover import router_metric
from tests.e2e.test_models import TINY, sixteen_mixed_streams_are_exact


async def decode_entries(stack: Stack) -> list[NodeInfo]:
    bus = await Bus(stack.nats_url, "e2e-shared", stack.auth).connect()
    try:
        nodes = (await (await NodeRegistry(bus).start()).nodes()).values()
    finally:
        await bus.close()
    return [n for n in nodes if n.role == "decode"]


def batched_reference(model: LoadedModel, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy continuations of every prompt, from one in-process engine running them as
    one batch (held to transformers' `generate` by the integration tests, as the chaos
    tests' reference is): twelve `generate` calls in turn took 2 of this test's 3 minutes
    on a slow host (180 s against 58 s with this)."""
    engine = Engine(model, EngineConfig(kv_cache_bytes=1 << 30))
    return engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0))


def process_of(node_id: str) -> str:
    """The launcher's name of the process a decode node runs in (`decode-1-m2` → `decode-1`)."""
    base, _, model = node_id.rpartition("-m")
    return base if base and model.isdigit() else node_id


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Stack]:
    argv = [
        "--model", MODEL,
        "--model", f"{TINY}={tiny_model_dir}",
        "--prefill", "1",
        "--decode", "2",
        "--shared-decode",
        "--kvcache", "1",
        "--transport", "tcp",
        "--kv-cache-mb", "128",  # one budget per decode process, both models' blocks
        "--heartbeat-ttl", "2",
        "--port", str(free_port()),
    ]  # fmt: skip
    log = tmp_path_factory.mktemp("shared-decode") / "stack.log"
    with running_stack(argv, log) as stack:
        deadline = time.monotonic() + 300
        while len(asyncio.run(decode_entries(stack))) < 4:
            assert time.monotonic() < deadline, "the decode processes' 4 nodes did not register"
            time.sleep(0.5)
        yield stack


def test_each_decode_process_hosts_both_models_and_answers_are_exact(
    shared: Stack, real_model: LoadedModel, tiny_model: LoadedModel
) -> None:
    stack = shared
    entries = asyncio.run(decode_entries(stack))
    hosted = {(process_of(n.node_id), n.model) for n in entries}
    assert hosted == {(p, m) for p in ("decode-1", "decode-2") for m in (MODEL, TINY)}
    assert [c.name for c in stack.children if c.name.startswith("decode")] == [
        "decode-1",
        "decode-2",
    ]
    sixteen_mixed_streams_are_exact(stack, real_model, tiny_model)
    # each model's node logs as itself, naming its model (not as the process's first node)
    assert stack.out is not None
    lines = [json.loads(line.split("] ", 1)[1]) for line in Path(stack.out.name).read_text()
             .splitlines() if line.startswith("[decode-") and "] {" in line]  # fmt: skip
    admitted = {(e["node_id"], e.get("model")) for e in lines if "admitted" in e["event"]}
    assert {m for _, m in admitted} == {MODEL, TINY}, admitted  # wherever they were placed
    assert all(m == TINY for n, m in admitted if n.endswith("-m2"))
    assert all(m == MODEL for n, m in admitted if not n.endswith("-m2"))


def test_a_load_of_both_models_adds_a_decode_process_hosting_both_and_removes_it_after(
    shared: Stack, real_model: LoadedModel, tiny_model: LoadedModel
) -> None:
    """`--shared-decode --autoscale`: the decode controller sees each process as one node
    (both models' sequences counted), starts a third process, which hosts both models and
    takes requests of both, and drains it away once the load is over."""
    stack = shared
    policy = quick_policy({"decode": RoleBounds(2, 3)})  # 3 sequences a process call for one more
    backend = LocalBackend(stack)

    async def run() -> tuple[list[str], list[Decision]]:
        bus = await Bus(stack.nats_url, "autoscaler", stack.auth).connect()
        controller = Controller(
            bus, backend, policy, interval=0.5, roles=("decode",), by_process=True
        )
        stop = asyncio.Event()
        loop_task = asyncio.create_task(controller.run(stop))
        runs = [(MODEL, 48), (TINY, 300)] * 6
        try:
            # The waves are up to minutes apart: the client lets an idle connection go well
            # before the router's --idle-timeout (10 s) closes it, or a reused one can be
            # closed under the next request (ServerDisconnectedError, seen once in CI).
            connector = aiohttp.TCPConnector(keepalive_timeout=5)
            async with aiohttp.ClientSession(connector=connector) as session:

                def wave(first: int) -> list[asyncio.Task[str]]:
                    return [
                        asyncio.create_task(
                            complete(
                                session,
                                stack.url,
                                [5, 6, 7, first + i],
                                n,
                                {"model": m, "ignore_eos": True},
                            )
                        )
                        for i, (m, n) in enumerate(runs)
                    ]

                streams = wave(100)
                deadline = time.monotonic() + 240
                while len({process_of(n.node_id) for n in await decode_entries(stack)}) < 3:
                    assert time.monotonic() < deadline, "no third decode process registered"
                    await asyncio.sleep(0.5)
                while len(await decode_entries(stack)) < 6:  # both its models' nodes
                    assert time.monotonic() < deadline, "the new process lacks a model"
                    await asyncio.sleep(0.5)
                streams += wave(200)  # the router spreads it over all three
                texts = list(await asyncio.gather(*streams))
                while backend.count("decode") > 2:
                    assert time.monotonic() < deadline, "decode was not scaled back down"
                    await asyncio.sleep(0.5)
                # within the loop: the thread that started it is the loop's executor's,
                # and a child gets SIGTERM when that thread ends (shared/procs.py)
                new = stack.child("decode-3")
                assert new.proc is not None
                exited = await asyncio.to_thread(new.proc.wait, 60)
                assert exited == 0  # drained, then exited
        finally:
            stop.set()
            await loop_task
            await bus.close()
        return texts, [d for _, d in controller.decisions]

    texts, decisions = asyncio.run(run())
    assert len(texts) == 24 and all(texts)  # every stream of both waves completed
    assert [d.delta for d in decisions] == [1, -1]
    assert decisions[1].remove == ("decode-3",)  # the process, by its first node's id
    served = {
        m: router_metric(stack, "tandem_node_requests_total", role="decode", node=n)
        for m, n in ((MODEL, "decode-3"), (TINY, "decode-3-m2"))
    }
    assert all(v > 0 for v in served.values()), served  # it took requests of both models


def test_a_process_hosting_both_models_killed_mid_stream_loses_no_stream(
    shared: Stack, real_model: LoadedModel, tiny_model: LoadedModel
) -> None:
    stack = shared
    # The router gathers a model's streams on the process where that model already runs
    # and spills onto an idle process once its own carries 10 more (`best_decode`): 12
    # streams of the real model put 11 on one process and 1 on the other; the tiny
    # model's streams, sent once all of those are placed, join the less loaded process,
    # which then runs both models. The tiny model steps far faster: its streams are longer.
    runs = [(real_model, MODEL, 64)] * 12 + [(tiny_model, TINY, 400)] * 4
    first_tiny = 12
    prompt = "Once upon a time, in a land far away,"
    ids = [model.tokenizer.encode(prompt + " " * i) for i, (model, _, _) in enumerate(runs)]
    events: list[list[str]] = [[] for _ in runs]

    async def run() -> tuple[list[str], str]:
        async with aiohttp.ClientSession() as session:

            def start(i: int) -> asyncio.Task[str]:
                (_, name, n), prompt_ids = runs[i], ids[i]
                return asyncio.create_task(
                    complete(session, stack.url, prompt_ids, n, {"model": name}, events[i])
                )

            streams = [start(i) for i in range(first_tiny)]
            deadline = time.monotonic() + 120
            while min(len(e) for e in events[:first_tiny]) < 1:  # every one placed
                assert time.monotonic() < deadline, "the real model's streams did not start"
                await asyncio.sleep(0.05)
            streams += [start(i) for i in range(first_tiny, len(runs))]

            async def victim() -> str | None:
                """A process running streams of both models, once every stream is under way."""
                if min(len(e) for e in events) < 4:
                    return None
                busy: dict[str, set[str]] = {}
                for n in await decode_entries(stack):
                    if n.running > 0:
                        busy.setdefault(process_of(n.node_id), set()).add(n.model)
                return next((p for p, models in busy.items() if len(models) == 2), None)

            while (chosen := await victim()) is None:
                assert time.monotonic() < deadline, "no process ran streams of both models"
                await asyncio.sleep(0.1)
            await asyncio.to_thread(stack.kill, chosen)
            return list(await asyncio.gather(*streams)), chosen

    got, killed = asyncio.run(run())
    assert killed in ("decode-1", "decode-2")
    expected = [
        *batched_reference(real_model, ids[:first_tiny], runs[0][2]),
        *batched_reference(tiny_model, ids[first_tiny:], runs[-1][2]),
    ]
    for (model, name, _), want, text in zip(runs, expected, got, strict=True):
        assert text == text_of(model, want), name
    deadline = time.monotonic() + 20  # both of its nodes leave the registry with it
    while killed in {process_of(n.node_id) for n in asyncio.run(decode_entries(stack))}:
        assert time.monotonic() < deadline, f"{killed}'s nodes still registered"
        time.sleep(0.5)
