"""Conditional disaggregation: the per-request choice between prefilling on the decode node
and on the prefill pool, from a profile's costs and the router's backlog counts, and its
fallback rule without a profile."""

from __future__ import annotations

import argparse

import msgspec
import pytest

from services.router.conditional import Backlog, PrefillPathChooser
from services.router.nodes import PREFILL_POOL, NodeTable
from services.router.routing import PrefixRouter
from shared.bus.kv_events import KVIndex
from shared.bus.messages import NodeInfo
from shared.costs.model import CostModel
from shared.costs.profile import KVCopyPoint
from shared.runtime.options import target_seconds
from tests.unit.test_plan_simulate import DECODE_STEP, PREFILL_PER_TOKEN, profile

pytestmark = pytest.mark.unit


def decode(running: int = 0, free: int = 900) -> NodeInfo:
    return NodeInfo(
        node_id="d1", role="decode", running=running, free_kv_blocks=free,
        total_kv_blocks=1000, hash_key="k", block_size=16,
    )  # fmt: skip


def chooser(costs: bool = True) -> PrefillPathChooser:
    return PrefillPathChooser(CostModel(profile()) if costs else None, local_max_tokens=96)


def test_an_idle_decode_node_prefills_locally_a_busy_one_sends_it_to_an_idle_pool() -> None:
    idle_pool = Backlog(pool_tokens=0, prefill_nodes=1, local_tokens=0)
    choice = chooser().choose(1000, 1000, 1000, decode(running=0), idle_pool)
    assert choice.local and "local" in choice.reason  # same prefill, no transfer
    busy = chooser().choose(1000, 1000, 1000, decode(running=8), idle_pool)
    # 8 decoding: 1,000 tokens in chunks of 248, 5 steps of 50 ms on top of the prefill
    assert not busy.local and "remote" in busy.reason


def test_a_backlogged_pool_sends_the_prompt_local() -> None:
    c = chooser()
    node = decode(running=8)
    queued = Backlog(pool_tokens=3000, prefill_nodes=1, local_tokens=0)  # 3 s queued
    local = c.local_seconds(200, node, 0)
    assert local == pytest.approx(DECODE_STEP + 200 * PREFILL_PER_TOKEN, rel=0.05)  # one chunk
    # 0.25 s + 8 streams x 0.2 s of stall, against 3 s of queue + 0.2 s: local
    assert c.choose(200, 200, 200, node, queued).local
    # ... unless that node's own local queue is longer still
    assert not c.choose(200, 200, 200, node, Backlog(3000, 1, local_tokens=6000)).local


def test_a_long_prompt_stays_off_a_busy_decode_node_unless_the_pool_is_far_behind() -> None:
    """1,000 tokens beside 8 streams stall each for 1 s: 8 s of added latency in all."""
    c, node = chooser(), decode(running=8)
    assert not c.choose(1000, 1000, 1000, node, Backlog(3000, 1, 0)).local
    assert c.choose(1000, 1000, 1000, node, Backlog(12000, 1, 0)).local


def test_the_kv_copies_weigh_on_the_remote_side() -> None:
    """With the profile's KV copies, the remote path also costs the prefill node's export
    and the decode node's import, and its streams wait for the import: a prompt the pool
    would take without them stays local when they are dear."""
    node, queued = decode(running=8), Backlog(pool_tokens=1500, prefill_nodes=1, local_tokens=0)
    # local: 0.25 s + 8 x 0.2 s of stall = 1.85 s; remote: 1.5 s queued + 0.2 s = 1.7 s
    assert not chooser().choose(200, 200, 200, node, queued).local
    copies = [
        KVCopyPoint(op=op, tokens=t, seconds=t * 0.05 / 200)
        for op in ("export", "import")
        for t in (100, 1000)
    ]
    costs = CostModel(msgspec.structs.replace(profile(), kv_copy=copies))
    dear = PrefillPathChooser(costs, local_max_tokens=96)
    # remote now 1.7 + 0.05 + 0.05 s, and 8 streams x 0.05 s of import stall
    assert dear.remote_seconds(200, 200, queued) == pytest.approx(1.8, abs=0.01)
    choice = dear.choose(200, 200, 200, node, queued)
    assert choice.local and "their stall 0.400s" in choice.reason


def test_short_tails_and_pool_less_clusters_stay_local() -> None:
    idle = Backlog(0, 1, 0)
    assert chooser().choose(50, 1000, 1000, decode(running=30), idle).local
    assert chooser().choose(4000, 4000, 4000, decode(running=30), Backlog(0, 0, 0)).local


def test_a_conditional_router_serves_with_its_prefill_pool_scaled_to_none() -> None:
    """No prefill node up (`--prefill-min 0` at a light load): the router stays ready and
    plans every prompt on a decode node; a split router is not ready without one."""
    table = NodeTable(registry=None, prefill_optional=True)  # type: ignore[arg-type]
    table.nodes = {"d1": decode(running=8)}
    assert table.ready() and table.pool_less()  # a refused local prefill: 503, not queued
    plan = PrefixRouter(table, KVIndex(), 96, chooser=chooser()).plan(list(range(2000)), 70)
    assert plan.local_node is not None and plan.local_node.node_id == "d1"
    table.nodes = {"d1": decode(), "p1": NodeInfo(node_id="p1", role="prefill")}
    assert not table.pool_less()  # a pool again: the queue is the fallback
    split = NodeTable(registry=None)  # type: ignore[arg-type]
    split.nodes = {"d1": decode()}
    assert not split.ready() and not split.pool_less()
    table.nodes = {}
    assert not table.ready()  # a decode node is needed all the same


def test_fallback_rule_without_a_profile() -> None:
    c = chooser(costs=False)
    assert not c.choose(1000, 1000, 1000, decode(), Backlog(1000, 1, 0)).local
    assert c.choose(1000, 1000, 1000, decode(), Backlog(5000, 2, 0)).local  # 2,500 a node queued
    assert not c.choose(1000, 1000, 1000, decode(), Backlog(5000, 2, 500)).local


def test_router_applies_the_choice_and_counts_the_backlog() -> None:
    table = NodeTable(registry=None)  # type: ignore[arg-type]
    prefill = NodeInfo(node_id="p1", role="prefill", hash_key="k", block_size=16)
    table.nodes = {"d1": decode(running=8), "p1": prefill}
    router = PrefixRouter(table, KVIndex(), 96, chooser=chooser())
    prompt = list(range(1000, 2000))
    plan = router.plan(prompt, 70)
    assert plan.local_node is None and plan.reason.startswith("local")  # remote: idle pool
    table.prefill_sent("r1", PREFILL_POOL, 12000)  # 12 s queued: worth 8 s of stall
    plan = router.plan(prompt, 70)
    assert plan.local_node is not None and plan.local_node.node_id == "d1"
    assert table.backlog_tokens(PREFILL_POOL) == 12000
    table.prefill_done("r1")
    table.prefill_done("r1")  # idempotent: the first token and the end both say it
    assert table.backlog_tokens(PREFILL_POOL) == 0 and not table.prefill_backlog


def test_a_tpot_target_holds_local_prefills_to_what_the_streams_can_spare() -> None:
    """Steps of 50 ms against a 130 ms target, aimed at 104 ms (TPOT_AIM): local prefills
    may take 52% of the node's time, 5.19 s of the last 10 s; 200-token prompts (0.2 s
    each) past that go remote."""
    now = [0.0]
    c = PrefillPathChooser(
        CostModel(profile()), local_max_tokens=96, tpot_target=0.13, clock=lambda: now[0]
    )
    node, queued = decode(running=8), Backlog(pool_tokens=30000, prefill_nodes=1, local_tokens=0)
    assert not chooser().choose(200, 200, 200, node, queued).reason.startswith("tpot")
    local = []
    for _ in range(30):
        local.append(c.choose(200, 200, 200, node, queued))
        now[0] += 0.1
    assert [x.local for x in local] == [True] * 25 + [False] * 5
    assert local[-1].reason.startswith("tpot: local prefills 5.00s + 0.20s in 10s > 52%")
    assert "remote" in local[-1].reason  # the cost comparison it overrode
    now[0] += 7.0  # the first prefills are out of the window: room for a few more
    assert c.choose(200, 200, 200, node, queued).local
    # an idle node has no streams to slow down; a target below the step time, no room
    assert c.choose(200, 200, 200, decode(running=0), queued).local
    tight = PrefillPathChooser(CostModel(profile()), tpot_target=0.04, clock=lambda: 0.0)
    assert not tight.choose(100, 100, 100, node, queued).local
    assert tight.choose(100, 100, 100, node, Backlog(30000, 0, 0)).local  # no prefill node


def test_a_tpot_target_needs_costs_and_a_valid_number() -> None:
    from services.router.main import path_chooser

    args = argparse.Namespace(
        profile=None, tpot_target=0.25, local_prefill_max_tokens=96,
        step_token_budget=64, prefill_chunk_tokens=512,
    )  # fmt: skip
    with pytest.raises(SystemExit, match="--tpot-target needs --profile"):
        path_chooser(args)
    assert path_chooser(argparse.Namespace(**{**vars(args), "tpot_target": 0.0})).costs is None
    assert target_seconds("0.25") == 0.25 and target_seconds("0") == 0.0
    for bad in ("-1", "nan", "inf", "fast"):
        with pytest.raises(argparse.ArgumentTypeError):
            target_seconds(bad)
