"""The autoscaler on real processes: a load spike adds a decode node, the end of it takes the
node away again, and no request fails or loses a token on the way; with the SLO policy, a
rise in the arrival rate adds the prefill node the planner sizes for it, and the drop after
removes it.

Its own small stack (1 prefill, 1 decode, thresholds low enough for a 2-core machine), the
real controller and policy, and the local backend (child processes of the stack; removal is
SIGTERM, so the node drains first).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.request
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import msgspec
import openai
import pytest

from shared.bus.client import Bus
from shared.bus.server import free_port
from shared.costs.profile import PrefillPoint
from tandem.autoscale.controller import Controller
from tandem.autoscale.local_backend import LocalBackend
from tandem.autoscale.metrics import AutoscaleMetrics
from tandem.autoscale.policy import Policy, PolicyConfig
from tandem.autoscale.sizer import Sizer
from tandem.autoscale.slo import SloPolicy
from tandem.autoscale.types import Observation, RoleBounds, Slo, SloConfig
from tandem.launcher import Stack
from tests.e2e.conftest import running_stack
from tests.e2e.test_api import MODEL
from tests.e2e.test_failover import router_metric
from tests.unit.test_plan_simulate import profile

pytestmark = pytest.mark.e2e

STREAMS = 8
TOKENS = 48
HIGH = 3  # running sequences per decode node that call for another one


@pytest.fixture(scope="module")
def small_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    argv = [
        "--prefill", "1",
        "--decode", "1",
        "--port", str(free_port()),
        "--transport", "tcp",
        "--kv-cache-mb", "128",
        "--kvcache-mb", "128",
        "--heartbeat-ttl", "2",
    ]  # fmt: skip
    with running_stack(argv, tmp_path_factory.mktemp("autoscale") / "stack.log") as s:
        yield s


def quick_policy(bounds: dict[str, RoleBounds]) -> Policy:
    """The seed policy with thresholds and windows for a 2-core machine and a test's time:
    HIGH sequences a decode node call for another, short windows and cooldowns."""
    return Policy(
        PolicyConfig(
            decode_running_high=HIGH,
            decode_running_low=1,
            up_window=1.0,
            down_window=4.0,
            cooldown=2.0,
            down_after_up=5.0,
            bounds=bounds,
        )
    )


@contextlib.asynccontextmanager
async def autoscaled(
    stack: Stack, policy: Policy | SloPolicy
) -> AsyncIterator[tuple[Controller, LocalBackend, openai.AsyncOpenAI]]:
    """The real controller with `policy` over the stack's processes (sampling every 0.5 s)
    and a client of the stack, until the block ends."""
    backend = LocalBackend(stack)
    bus = await Bus(stack.nats_url, "autoscaler", stack.auth).connect()
    controller = Controller(bus, backend, policy, stack.url, interval=0.5,
                            metrics=AutoscaleMetrics())  # fmt: skip
    stop = asyncio.Event()
    loop_task = asyncio.create_task(controller.run(stop))
    c = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="-", max_retries=0, timeout=600)
    try:
        yield controller, backend, c
    finally:
        stop.set()
        await loop_task
        await c.close()
        await bus.close()


def crossing(history: list[Observation]) -> float | None:
    """When mean running sequences per serving decode node first reached HIGH."""
    for obs in history:
        nodes = obs.serving("decode")
        if nodes and sum(n.running for n in nodes) / len(nodes) >= HIGH:
            return obs.time
    return None


async def test_spike_scales_decode_up_and_back_down_without_failures(
    small_stack: Stack,
) -> None:
    policy = quick_policy({"decode": RoleBounds(1, 2), "prefill": RoleBounds(1, 1)})
    async with autoscaled(small_stack, policy) as (controller, backend, c):

        async def one(i: int) -> tuple[int, str]:
            done = await c.completions.create(
                model=MODEL,
                prompt=f"Story number {i}: once upon a time",
                max_tokens=TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert done.usage is not None
            return done.usage.completion_tokens, done.choices[0].text

        first = [asyncio.create_task(one(i)) for i in range(STREAMS)]
        deadline = time.monotonic() + 180
        while not (controller.history and len(controller.history[-1].serving("decode")) == 2):
            assert time.monotonic() < deadline, "no second decode node registered"
            # The spike lasts until the new node serves: a stream that ended is replaced (on
            # a fast host 8 streams of 48 tokens end in under 2 s, before the policy's
            # window has seen them long enough to act).
            for _ in range(STREAMS - sum(not t.done() for t in first)):
                first.append(asyncio.create_task(one(len(first))))
            await asyncio.sleep(0.1)  # refilled at once: the load must not dip below HIGH
        # A second wave once the new node serves: the router spreads it over both.
        second = [asyncio.create_task(one(len(first) + i)) for i in range(STREAMS)]
        results = await asyncio.gather(*first, *second)
        # Every request completed whole, with no error, across the scaling.
        assert [n for n, _ in results] == [TOKENS] * len(results)
        ups = [(t, d) for t, d in controller.decisions if d.role == "decode" and d.delta > 0]
        assert ups, "decode was never scaled up"
        crossed = crossing(list(controller.history))
        assert crossed is not None
        assert ups[0][0] - crossed <= 10.0  # decided within 10 s of crossing
        added = [c for c in small_stack.children if c.name == "decode-2"]
        assert added, "the new decode node was not started"
        served = {"role": "decode", "node": "decode-2"}
        assert router_metric(small_stack, "tandem_node_requests_total", **served) > 0
        # Load over: back to the minimum, by draining the node away (exit code 0).
        deadline = time.monotonic() + 120
        while backend.count("decode") > 1:
            assert time.monotonic() < deadline, "decode was not scaled back down"
            await asyncio.sleep(0.5)
        downs = [d for _, d in controller.decisions if d.role == "decode" and d.delta < 0]
        assert len(downs) == 1
        victim = small_stack.child(downs[0].remove[0])
        assert victim.proc is not None
        assert await asyncio.to_thread(victim.proc.wait, 60) == 0
        # Nothing flapped: exactly one step up and one step down.
        assert [d.delta for _, d in controller.decisions if d.role == "decode"] == [1, -1]
    print(f"decisions: {[(round(t - crossed, 1), d.reason) for t, d in controller.decisions]}")


def slow_prefill_profile(path: Path) -> str:
    """A profile whose prefill costs 80 ms a prompt token (a decode step 50 ms): the SLO
    policy's planner then needs a second prefill node for this test's prompts (~10 tokens)
    from ~1.5 requests a second, whatever this machine's real speed (the policy sizes from
    the load the router counts and the profile, not from the nodes' timings)."""
    base = profile()
    points = [PrefillPoint(tokens=t, batch=1, seconds=t * 0.08) for t in (64, 4096)]
    path.write_bytes(msgspec.json.encode(msgspec.structs.replace(base, prefill=points)))
    return str(path)


async def test_the_slo_policy_adds_a_prefill_node_for_a_ramp_and_removes_it_after(
    small_stack: Stack, tmp_path: Path
) -> None:
    bounds = {"decode": RoleBounds(1, 1), "prefill": RoleBounds(1, 2)}
    sizer = Sizer(slow_prefill_profile(tmp_path / "profile.json"), Slo(5.0, 0.5, 0.99), bounds)
    config = SloConfig(window=20, min_span=8, horizon=5, headroom=0.2, up_window=1,
                       down_window=10, down_after_up=10, bounds=bounds)  # fmt: skip
    policy = SloPolicy(sizer, config)
    sent: list[asyncio.Task[int]] = []
    started = time.monotonic()
    async with autoscaled(small_stack, policy) as (controller, backend, c):
        await ramp(small_stack, controller, backend, c, sent, started)
    print(f"decisions: {[(round(t - started, 1), d.reason) for t, d in controller.decisions]}")


async def note(c: openai.AsyncOpenAI, i: int) -> int:
    """One short request (~10 prompt tokens, 4 output); the tokens it got."""
    done = await c.completions.create(
        model=MODEL, prompt=f"Note {i}: the weather is", max_tokens=4, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert done.usage is not None
    return done.usage.completion_tokens


async def open_loop(
    c: openai.AsyncOpenAI,
    sent: list[asyncio.Task[int]],
    rate: float,
    until: Callable[[], bool],
    limit: float,
    what: str,
) -> None:
    """`note` requests at `rate` a second (open loop) until `until()`, for `limit` s at
    most (else `what` fails the test); each one's task in `sent`."""
    deadline = time.monotonic() + limit
    while not until():
        assert time.monotonic() < deadline, what
        sent.append(asyncio.create_task(note(c, len(sent))))
        await asyncio.sleep(1 / rate)


async def ramp(
    small_stack: Stack,
    controller: Controller,
    backend: LocalBackend,
    c: openai.AsyncOpenAI,
    sent: list[asyncio.Task[int]],
    started: float,
) -> None:
    """0.3 req/s for 12 s, 2 req/s until a second prefill node serves, 0.3 req/s until it
    is gone; then the checks."""

    async def load(rate: float, until: Callable[[], bool], limit: float, what: str) -> None:
        await open_loop(c, sent, rate, until, limit, what)

    await load(0.3, lambda: time.monotonic() - started > 12, 30, "")
    assert controller.decisions == deque(), "a move at the low rate"
    added = {"role": "prefill", "node": "prefill-2"}

    def second_serves() -> bool:
        return router_metric(small_stack, "tandem_node_requests_total", **added) > 0

    await load(2.0, second_serves, 120, "no second prefill node served in time")
    await load(0.3, lambda: backend.count("prefill") == 1, 120, "prefill not scaled down")
    results = await asyncio.gather(*sent)
    assert results == [4] * len(results)  # every request whole, across both moves
    moves = [(d.role, d.delta) for _, d in controller.decisions]
    assert moves == [("prefill", 1), ("prefill", -1)], moves  # no oscillation
    assert "planner sizes" in controller.decisions[0][1].reason
    metrics = controller.metrics
    assert metrics is not None
    assert metrics.decisions.labels("", "prefill", "up")._value.get() == 1
    assert metrics.decisions.labels("", "prefill", "down")._value.get() == 1
    assert metrics.replicas.labels("", "prefill")._value.get() in (1, 2)  # at the last tick
    assert metrics.infeasible.labels("")._value.get() == 0
    assert metrics.planned_rate.labels("")._value.get() > 0
    victim = small_stack.child(controller.decisions[1][1].remove[0])
    assert victim.proc is not None
    assert await asyncio.to_thread(victim.proc.wait, 60) == 0  # drained, then exited


async def test_a_conditional_routers_prefill_pool_goes_to_none_at_a_light_load_and_back(
    tmp_path: Path,
) -> None:
    """`--conditional --prefill-min 0`: at a light load the planner finds the decode node
    alone meets the SLO, the prefill node drains away and the router serves on (every
    prompt prefilled on the decode node, /readyz still ready); a heavier load brings a
    prefill node back. No request fails across either move."""
    profile_path = slow_prefill_profile(tmp_path / "profile.json")
    env = {"TANDEM_LOCAL_PREFILL_MAX_TOKENS": "0"}  # the costs choose the path, not length
    argv = [
        "--conditional", "--profile", profile_path,
        "--prefill", "1", "--decode", "1",
        "--port", str(free_port()),
        "--transport", "tcp",
        "--kv-cache-mb", "128",
        "--heartbeat-ttl", "2",
    ]  # fmt: skip
    bounds = {"decode": RoleBounds(1, 1), "prefill": RoleBounds(0, 1)}
    options = ["--conditional", "--local-prefill-max-tokens", "0"]
    sizer = Sizer(profile_path, Slo(5.0, 0.5, 0.99), bounds, options)
    config = SloConfig(window=20, min_span=8, horizon=5, headroom=0.2, up_window=1,
                       down_window=10, down_after_up=10, bounds=bounds)  # fmt: skip
    sent: list[asyncio.Task[int]] = []
    with running_stack(argv, tmp_path / "stack.log", env) as stack:
        async with autoscaled(stack, SloPolicy(sizer, config)) as (controller, backend, c):

            async def load(rate: float, until: Callable[[], bool], limit: float, what: str) -> None:
                await open_loop(c, sent, rate, until, limit, what)

            await load(0.3, lambda: backend.count("prefill") == 0, 120, "prefill not scaled to 0")
            victim = stack.child(controller.decisions[0][1].remove[0])
            assert victim.proc is not None
            assert await asyncio.to_thread(victim.proc.wait, 60) == 0  # drained, then exited
            after = len(sent)
            await load(0.3, lambda: len(sent) >= after + 4, 30, "")  # served without a pool
            with urllib.request.urlopen(stack.url + "/readyz", timeout=5) as r:
                ready = json.loads(r.read())
            assert ready["ready"] and ready["prefill"] == 0, ready
            await load(1.5, lambda: backend.count("prefill") == 1, 120, "no prefill node back")
            results = await asyncio.gather(*sent)  # (before the client closes)
    assert results == [4] * len(results)  # every request whole, across both moves
    moves = [(d.role, d.delta) for _, d in controller.decisions]
    assert moves == [("prefill", -1), ("prefill", 1)], moves
    assert "0P+1D" in controller.decisions[0][1].reason
