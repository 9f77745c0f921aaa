"""Colocated mode and core pinning: the routing decision, readiness, and what `tandem up`
would start (`Stack.plan`, nothing spawned)."""

from __future__ import annotations

import os

import pytest

from services.router.nodes import NodeTable
from services.router.routing import PrefixRouter
from shared.bus.kv_events import KVIndex
from shared.bus.messages import KVEvent, NodeInfo
from shared.kv.block_hash import block_hashes
from tandem.cli import build_parser
from tandem.launcher import Stack, prefill_nodes
from tandem.up import run
from tests.unit.test_routing import KEY, decode_node

pytestmark = pytest.mark.unit

CPUS = sorted(os.sched_getaffinity(0))


def cpu(k: int) -> set[int]:
    return {CPUS[k % len(CPUS)]}


def table(nodes: list[NodeInfo], colocated: bool) -> NodeTable:
    t = NodeTable(registry=None, colocated=colocated)  # type: ignore[arg-type]
    t.nodes = {n.node_id: n for n in nodes}
    return t


def test_colocated_sends_every_request_to_a_decode_node_by_load() -> None:
    nodes = [decode_node("d1", free=40, running=3), decode_node("d2", free=90, running=1)]
    t = table(nodes, colocated=True)
    prompt = list(range(1000, 2500))  # 1,500 tokens, nothing cached anywhere
    plan = PrefixRouter(t, KVIndex(), colocated=True).plan(prompt, 60)
    assert plan.local_node is not None and plan.local_node.node_id == "d2"
    assert t.inflight == {}  # choosing is not sending: the router counts what it sends
    # the same request, disaggregated, goes to a prefill node
    assert PrefixRouter(table(nodes, False), KVIndex()).plan(prompt, 60).local_node is None


def test_colocated_prefers_the_node_holding_the_prefix_whatever_the_tail() -> None:
    prompt = list(range(100, 700))  # 600 tokens
    index = KVIndex()
    hashes = block_hashes(prompt, 16, KEY.encode())[:2]  # 32 cached: a long uncached tail
    index.apply(KVEvent(node_id="d1", op="stored", block_hashes=list(hashes)))
    nodes = [decode_node("d1", running=5), decode_node("d2")]
    plan = PrefixRouter(table(nodes, True), index, colocated=True).plan(prompt, 50)
    assert plan.local_node is not None and plan.local_node.node_id == "d1"
    assert plan.decode_cached_tokens == 32
    assert PrefixRouter(table(nodes, False), index).plan(prompt, 50).local_node is None


def test_colocated_is_ready_without_prefill_nodes() -> None:
    assert table([decode_node("d1")], colocated=True).ready()
    assert not table([decode_node("d1")], colocated=False).ready()
    assert not table([], colocated=True).ready()
    plan = PrefixRouter(table([], True), KVIndex(), colocated=True).plan([1, 2, 3], 1)
    assert plan.local_node is None  # no decode node: the router answers 503


def plan_of(*argv: str) -> tuple[Stack, dict[str, list[str]]]:
    stack = Stack(build_parser().parse_args(["up", *argv]))
    return stack, {c.name: c.argv for c in stack.plan()}


def threads(argv: list[str]) -> int:
    return int(argv[argv.index("--threads") + 1])


def test_up_colocated_starts_no_prefill_node() -> None:
    for argv in (["--colocated"], ["--prefill", "0"]):
        stack, children = plan_of(*argv, "--kvcache", "0")
        assert prefill_nodes(stack.args) == 0
        assert sorted(children) == ["decode-1", "router"]
        assert "--colocated" in children["router"]
        assert threads(children["decode-1"]) == len(CPUS)  # every core for the one engine
    _, children = plan_of("--kvcache", "0")
    assert sorted(children) == ["decode-1", "prefill-1", "router"]
    assert "--colocated" not in children["router"]


def test_up_refuses_prefill_nodes_with_colocated(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(build_parser().parse_args(["up", "--colocated", "--prefill", "2"])) == 2
    assert run(build_parser().parse_args(["up", "--prefill", "-1"])) == 2
    assert "--prefill" in capsys.readouterr().err


def test_pin_cores_gives_each_model_node_a_core_and_one_thread() -> None:
    stack, children = plan_of("--prefill", "1", "--decode", "1", "--pin-cores")
    assert stack.affinity == {"prefill-1": cpu(0), "decode-1": cpu(1)}
    assert threads(children["prefill-1"]) == 1 and threads(children["decode-1"]) == 1
    assert "kvcache-1" not in stack.affinity and "router" not in stack.affinity
    stack, _ = plan_of("--prefill", "2", "--decode", "2", "--pin-cores")
    assert [stack.affinity[f"prefill-{i}"] for i in (1, 2)] == [cpu(0), cpu(1)]  # round-robin
    assert [stack.affinity[f"decode-{i}"] for i in (1, 2)] == [cpu(2), cpu(3)]


def test_up_passes_its_chunking_options_to_the_model_nodes_and_the_router() -> None:
    def option(argv: list[str], flag: str) -> str:
        return argv[argv.index(flag) + 1]

    _, children = plan_of("--kvcache", "0", "--step-token-budget", "0")
    for name in ("prefill-1", "decode-1", "router"):
        assert option(children[name], "--step-token-budget") == "0"
    _, children = plan_of("--kvcache", "0", "--colocated", "--prefill-chunk-tokens", "128")
    assert option(children["decode-1"], "--prefill-chunk-tokens") == "128"
    assert option(children["decode-1"], "--step-token-budget") == "256"  # the default
    # beside prefill nodes, the decode nodes' streams come first: smaller chunks by default,
    # and the router's conditional choice models the same
    _, children = plan_of("--kvcache", "0", "--conditional")
    for name in ("decode-1", "router"):
        assert option(children[name], "--step-token-budget") == "64"


def test_up_starts_each_models_nodes_and_gives_the_router_every_model() -> None:
    def option(argv: list[str], flag: str) -> list[str]:
        return [argv[i + 1] for i, a in enumerate(argv) if a == flag]

    _, children = plan_of(
        "--kvcache", "0", "--model", "a=/m/a", "--model", "b=/m/b", "--decode", "2"
    )
    models = {name: option(argv, "--model") for name, argv in children.items()}
    assert models == {
        "prefill-1": ["a=/m/a"],
        "prefill-2": ["b=/m/b"],
        "decode-1": ["a=/m/a"],
        "decode-2": ["a=/m/a"],
        "decode-3": ["b=/m/b"],
        "decode-4": ["b=/m/b"],
        "router": ["a=/m/a", "b=/m/b"],
    }
    assert {threads(children[n]) for n in models if n != "router"} == {1}  # 6 nodes share
    _, children = plan_of("--kvcache", "0")  # no --model: the default model, once
    assert option(children["router"], "--model") == ["smollm2-135m-instruct"]
