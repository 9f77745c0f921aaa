"""Autoscaling per model against a real nats-server: each model's controller sees only its
model's nodes (registry) and prefill queue (JetStream), and one model's load starts nodes
of that model alone."""

from __future__ import annotations

import time

import pytest

from shared.bus.client import Bus
from shared.bus.ids import AttemptId
from shared.bus.messages import PrefillJob
from shared.bus.registry import NodeRegistry, node_info
from shared.bus.server import NatsServer
from shared.bus.topology import (
    TopologyConfig,
    ensure_job_consumer,
    ensure_topology,
    prefill_consumer,
    prefill_subject,
)
from shared.bus.workqueue import submit_job
from shared.sampling_params import SamplingParams
from tandem.autoscale.controller import Controller
from tandem.autoscale.policy import Policy, PolicyConfig

pytestmark = pytest.mark.integration


class CountingBackend:
    """A backend that counts what it is asked (the real ones: tandem/autoscale/*_backend.py,
    the local one tested in tests/unit/test_autoscale_local.py and tests/e2e)."""

    def __init__(self, nodes: dict[str, int]) -> None:
        self.nodes = nodes
        self.started: list[str] = []

    def count(self, role: str) -> int:
        return self.nodes[role]

    def scale_up(self, role: str, n: int) -> list[str]:
        self.nodes[role] += n
        self.started += [role] * n
        return [f"{role}-new"] * n

    def scale_down(self, role: str, node_ids: list[str]) -> None:
        self.nodes[role] -= len(node_ids)


async def test_each_models_controller_sees_and_scales_its_own_pool(
    nats_server: NatsServer,
) -> None:
    bus = await Bus(nats_server.url, "autoscale-test").connect()
    try:
        assert bus.js is not None
        await ensure_topology(bus.js, TopologyConfig())
        for model in ("a", "b"):
            await ensure_job_consumer(bus.js, prefill_consumer(model), prefill_subject(model))
        registry = await NodeRegistry(bus, ttl=30).start()
        for model, running in (("a", 20), ("b", 1)):  # a's decode node is busy, b's idle
            await registry.heartbeat(node_info(f"decode-{model}", "decode", model=model,
                                               running=running, total_kv_blocks=100,
                                               free_kv_blocks=90))  # fmt: skip
            await registry.heartbeat(node_info(f"prefill-{model}", "prefill", model=model))
        for i in range(3):  # three of b's jobs wait, none of a's
            job = PrefillJob(
                attempt_id=AttemptId(f"cmpl-b{i}"),
                prompt_ids=[1, 2, 3],
                params=SamplingParams(max_tokens=2),
                deadline=time.time() + 60,
                model="b",
            )
            await submit_job(bus, job)
        quick = PolicyConfig(up_window=0.0, queue_high=2.0)
        pools = {m: CountingBackend({"prefill": 1, "decode": 1}) for m in ("a", "b")}
        controllers = {
            m: Controller(bus, pools[m], Policy(quick), model=m, interval=0.1) for m in pools
        }
        seen = {m: await c.sample() for m, c in controllers.items()}
        assert {n.node_id for n in seen["a"].nodes} == {"decode-a", "prefill-a"}
        assert {n.node_id for n in seen["b"].nodes} == {"decode-b", "prefill-b"}
        assert (seen["a"].prefill_queue, seen["b"].prefill_queue) == (0, 3)
        every = await Controller(bus, CountingBackend({}), Policy(quick)).sample()
        assert len(every.nodes) == 4 and every.prefill_queue == 3
        for _ in range(2):  # the first tick starts each condition's window, the next acts
            for c in controllers.values():
                await c.tick()
        # a's busy decode node starts a decode node of a; b's queue a prefill node of b
        assert set(pools["a"].started) == {"decode"} and set(pools["b"].started) == {"prefill"}
    finally:
        await bus.close()


async def test_a_shared_decode_pool_is_scaled_by_process_and_by_one_controller(
    nats_server: NatsServer,
) -> None:
    """Decode processes hosting both models (`--shared-decode`): the decode controller sees
    each process as one node carrying both models' sequences, and scales it; the models'
    own controllers scale their prefill nodes alone (their backends have no decode count)."""
    bus = await Bus(nats_server.url, "autoscale-shared").connect()
    try:
        assert bus.js is not None
        await ensure_topology(bus.js, TopologyConfig())
        registry = await NodeRegistry(bus, ttl=30).start()
        # process decode-1 runs 5 sequences of each model (10: past the threshold of 8),
        # its KV half used by one model's entry; decode-2 runs 4 + 5
        for host, running in (("decode-1", (5, 5)), ("decode-2", (4, 5))):
            for node_id, model, n in zip((host, host + "-m2"), "ab", running, strict=True):
                free = 50 if node_id == "decode-1" else 90
                info = node_info(
                    node_id, "decode", model=model, host=host, hosted_models=2, running=n,
                    total_kv_blocks=100, free_kv_blocks=free,
                )  # fmt: skip
                await registry.heartbeat(info)
        for model in "ab":
            await registry.heartbeat(node_info(f"prefill-{model}", "prefill", model=model))
        quick = PolicyConfig(up_window=0.0)
        shared = CountingBackend({"decode": 2})
        decode = Controller(bus, shared, Policy(quick), roles=("decode",), by_process=True)
        seen = await decode.sample()
        processes = {n.node_id: n for n in seen.serving("decode")}
        assert set(processes) == {"decode-1", "decode-2"}
        assert (processes["decode-1"].running, processes["decode-2"].running) == (10, 9)
        assert processes["decode-1"].kv_used == 0.5  # the fullest entry's: one budget
        pools = {m: CountingBackend({"prefill": 1}) for m in "ab"}
        models = [
            Controller(bus, pools[m], Policy(quick), model=m, roles=("prefill",)) for m in "ab"
        ]
        for _ in range(2):  # the first tick starts each condition's window, the next acts
            for c in [decode, *models]:
                await c.tick()
        assert shared.started == ["decode"]  # 19 sequences over 2 processes: one more
        assert all(not p.started for p in pools.values())  # no model's pool touched decode
    finally:
        await bus.close()
