"""KV-aware routing decisions on a synthetic cluster view and KV-event index."""

from __future__ import annotations

import msgspec
import pytest

from services.router.nodes import NodeTable
from services.router.routing import PrefixRouter
from shared.bus.kv_events import KVIndex
from shared.bus.messages import KVEvent, NodeInfo
from shared.kv.block_hash import block_hashes

pytestmark = pytest.mark.unit

KEY = "smollm2/float32"


def decode_node(name: str, free: int = 100, running: int = 0) -> NodeInfo:
    return NodeInfo(
        node_id=name,
        role="decode",
        free_kv_blocks=free,
        total_kv_blocks=100,
        running=running,
        hash_key=KEY,
        block_size=16,
    )


def router(nodes: list[NodeInfo], index: KVIndex, limit: int = 96) -> PrefixRouter:
    table = NodeTable(registry=None)  # type: ignore[arg-type]
    table.nodes = {n.node_id: n for n in nodes}
    return PrefixRouter(table, index, limit)


def held(index: KVIndex, node: str, prompt: list[int], blocks: int) -> None:
    hashes = block_hashes(prompt, 16, KEY.encode())[:blocks]
    index.apply(KVEvent(node_id=node, op="stored", block_hashes=list(hashes)))


def test_short_uncached_tail_goes_to_the_node_holding_the_prefix() -> None:
    prompt = list(range(100, 260))  # 160 tokens = 10 blocks
    index = KVIndex()
    held(index, "d1", prompt, 4)
    held(index, "d2", prompt, 9)
    plan = router([decode_node("d1"), decode_node("d2")], index).plan(prompt, 20)
    assert plan.local_node is not None and plan.local_node.node_id == "d2"
    assert plan.decode_cached_tokens == 144  # 16 uncached tokens left to compute there


def test_long_uncached_tail_or_no_room_takes_the_disaggregated_path() -> None:
    prompt = list(range(100, 420))  # 320 tokens
    index = KVIndex()
    held(index, "d1", prompt, 5)  # 240 uncached > 96
    held(index, "kv", prompt, 12)
    nodes = [decode_node("d1"), NodeInfo(node_id="kv", role="kvcache")]
    plan = router(nodes, index).plan(prompt, 30)
    assert plan.local_node is None
    assert plan.decode_cached_tokens == 80 and plan.kvcache_cached_tokens == 192
    held(index, "d1", prompt, 19)
    assert router([decode_node("d1", free=10)], index).plan(prompt, 30).local_node is None
    assert router([decode_node("d1", free=30)], index).plan(prompt, 30).local_node is not None
    assert router([decode_node("d1")], index, limit=0).plan(prompt, 30).local_node is None


def test_nothing_cached_anywhere_means_no_local_route() -> None:
    plan = router([decode_node("d1")], KVIndex()).plan(list(range(50)), 5)
    assert plan.local_node is None and plan.decode_cached_tokens == 0


def prefill_node(name: str, load: int = 0) -> NodeInfo:
    return NodeInfo(node_id=name, role="prefill", load=load, hash_key=KEY, block_size=16)


def test_a_long_prompt_is_steered_to_the_prefill_node_holding_its_prefix() -> None:
    prompt = list(range(100, 1100))  # 1,000 tokens: disaggregated whatever decode holds
    index = KVIndex()
    held(index, "p1", prompt, 20)
    held(index, "p2", prompt, 50)  # 800 tokens in its pool
    nodes = [decode_node("d1"), prefill_node("p1"), prefill_node("p2")]
    plan = router(nodes, index).plan(prompt, 70)
    assert plan.local_node is None
    assert plan.prefill_node is not None and plan.prefill_node.node_id == "p2"
    assert plan.prefill_cached_tokens == 800


def test_steering_weighs_what_kvcache_holds_and_each_node_s_queue() -> None:
    prompt = list(range(100, 1100))
    index = KVIndex()
    held(index, "p1", prompt, 50)
    kv = NodeInfo(node_id="kv", role="kvcache")
    # kvcache holds as much: p1 saves only the load (~0.06 x 800 = 48 tokens' work)
    held(index, "kv", prompt, 50)
    nodes = [decode_node("d1"), kv, prefill_node("p1"), prefill_node("p2")]
    assert router(nodes, index).plan(prompt, 70).prefill_node is not None
    # ...which a job already queued on p1 (and none on p2) outweighs
    busy = [decode_node("d1"), kv, prefill_node("p1", load=1), prefill_node("p2")]
    assert router(busy, index).plan(prompt, 70).prefill_node is None
    # a pool holding a little more than kvcache does not pay for the queue either...
    held(index, "p1", prompt, 52)
    assert router(busy, index).plan(prompt, 70).prefill_node is None
    # ...but one holding far more does (kvcache lost most of it)
    fresh = KVIndex()
    held(fresh, "p1", prompt, 60)
    held(fresh, "kv", prompt, 5)
    plan = router(busy, fresh).plan(prompt, 70)
    assert plan.prefill_node is not None and plan.prefill_node.node_id == "p1"


def test_no_prefill_pool_holding_anything_means_the_shared_queue() -> None:
    prompt = list(range(100, 1100))
    nodes = [decode_node("d1"), prefill_node("p1")]
    assert router(nodes, KVIndex()).plan(prompt, 70).prefill_node is None


def test_node_table_role_lists_follow_every_change() -> None:
    """The per-role lists routing reads are kept between changes: a new entry, a node
    starting to drain, a node changing role and one leaving each show at once; the
    table cannot be changed behind its back."""
    table = NodeTable(registry=None)  # type: ignore[arg-type]
    table.nodes = {"d1": decode_node("d1")}
    assert [n.node_id for n in table.by_role("decode")] == ["d1"]
    table.put(decode_node("d2", free=50))
    assert [n.node_id for n in table.by_role("decode")] == ["d1", "d2"]
    assert table.by_role("decode")[1].free_kv_blocks == 50
    table.put(decode_node("d2", free=70))  # its next heartbeat
    assert table.by_role("decode")[1].free_kv_blocks == 70
    draining = NodeInfo(node_id="d1", role="decode", draining=True, total_kv_blocks=100)
    table.put(draining)
    assert [n.node_id for n in table.by_role("decode")] == ["d2"]
    table.put(NodeInfo(node_id="d2", role="prefill"))
    assert table.by_role("decode") == [] and [n.node_id for n in table.by_role("prefill")] == ["d2"]
    assert table.drop("d2") is not None and table.by_role("prefill") == []
    assert table.drop("d9") is None
    with pytest.raises(TypeError):
        table.nodes["d3"] = decode_node("d3")  # type: ignore[index]
    assert "d3" not in table.nodes and "d1" in table.nodes


def test_the_choice_of_decode_node_follows_every_change() -> None:
    """best_decode weighs each node's fields as read at its last change: every new
    entry (a heartbeat, a node starting to drain, a role change), a node leaving and a
    whole new table show in the very next choice."""
    table = NodeTable(registry=None)  # type: ignore[arg-type]
    table.nodes = {"d1": decode_node("d1", free=90), "d2": decode_node("d2", free=50)}
    assert table.best_decode(2).node_id == "d1"  # type: ignore[union-attr]
    table.put(decode_node("d2", free=99))  # d2's next heartbeat: now the emptier
    assert table.best_decode(2).node_id == "d2"  # type: ignore[union-attr]
    table.put(NodeInfo(node_id="d2", role="decode", draining=True, total_kv_blocks=100))
    assert table.best_decode(2).node_id == "d1"  # type: ignore[union-attr]
    table.put(decode_node("d3", free=100))
    assert table.best_decode(2).node_id == "d3"  # type: ignore[union-attr]
    table.put(NodeInfo(node_id="d3", role="prefill"))
    assert table.best_decode(2).node_id == "d1"  # type: ignore[union-attr]
    assert table.drop("d1") is not None and table.best_decode(2) is None
    table.nodes = {"d4": decode_node("d4")}
    assert table.best_decode(2).node_id == "d4"  # type: ignore[union-attr]


def test_requests_are_routed_among_their_models_nodes_only() -> None:
    """Two models in one cluster: each request's decode node, conditional choice and
    prefill pool are its model's; a node of before several models (no model named) is
    taken for any; lists per (role, model) follow changes like the role lists."""

    def of(node: NodeInfo, model: str) -> NodeInfo:
        return msgspec.structs.replace(node, model=model)

    a1, b1 = of(decode_node("a1", free=10), "a"), of(decode_node("b1", free=90), "b")
    table = NodeTable(registry=None)  # type: ignore[arg-type]
    table.nodes = {n.node_id: n for n in (a1, b1, of(prefill_node("pa"), "a"))}
    assert table.pick_decode(2, model="a") == a1  # though b1 has far more room
    assert table.pick_decode(2, model="b") == b1
    assert table.pick_decode(2, model="c") is None
    assert table.ready("a") and not table.ready("b")  # b has no prefill node
    table.put(of(prefill_node("pb"), "b"))
    assert table.ready("b") and [n.node_id for n in table.by_role("prefill", "b")] == ["pb"]
    table.put(decode_node("old"))  # names no model: serves any
    assert {n.node_id for n in table.by_role("decode", "a")} == {"a1", "old"}
    table.drop("a1")
    assert [n.node_id for n in table.by_role("decode", "a")] == ["old"]
    plan = PrefixRouter(table, KVIndex()).plan(list(range(300)), 20, model="b")
    assert plan.model == "b" and plan.local_node is None


def test_a_models_requests_gather_where_its_process_runs_no_other_model() -> None:
    """Shared decode processes (each hosting both models): a model's request goes to the
    process where the other model runs least, even if its own batch is bigger there (so
    placement converges to a process per model); with the other model idle everywhere, to
    the least loaded node."""
    table = NodeTable(registry=None)  # type: ignore[arg-type]

    def hosted(name: str, running: int, host_running: int) -> NodeInfo:
        node = decode_node(name, running=running)
        return msgspec.structs.replace(
            node, load=running, host_running=host_running, hosted_models=2
        )

    table.nodes = {
        "p1": hosted("p1", running=4, host_running=4),  # model A alone on process 1
        "p2": hosted("p2", running=0, host_running=4),  # process 2 runs model B's 4
    }
    choice = table.best_decode(2)
    assert choice is not None and choice.node_id == "p1"
    table.nodes = {
        "p1": hosted("p1", running=12, host_running=12),
        "p2": hosted("p2", running=0, host_running=0),  # model B idles: p2 is free
    }
    choice = table.best_decode(2)
    assert choice is not None and choice.node_id == "p2"  # 10 more than an idle one
    table.nodes = {
        "p1": hosted("p1", running=8, host_running=8),
        "p2": hosted("p2", running=0, host_running=0),
    }
    choice = table.best_decode(2)
    assert choice is not None and choice.node_id == "p1"  # not yet: steady loads stay apart
    # both processes run both models: the one where this model has the larger share
    table.nodes = {
        "p1": hosted("p1", running=3, host_running=4),
        "p2": hosted("p2", running=1, host_running=4),
    }
    choice = table.best_decode(2)
    assert choice is not None and choice.node_id == "p1"
    # a single-model node states no host_running: as before, the least loaded one
    table.nodes = {"d1": decode_node("d1", running=4), "d2": decode_node("d2", running=1)}
    choice = table.best_decode(2)
    assert choice is not None and choice.node_id == "d2"


def test_a_request_sent_to_one_model_of_a_process_counts_for_its_other_models() -> None:
    """Two idle shared processes (p1, p2), each hosting models a and b. Model a's first
    request goes to one of them; model b's first request, sent before any heartbeat tells
    of a's, goes to the other process: what was sent to p2's node of a is p2's load."""
    table = NodeTable(registry=None)  # type: ignore[arg-type]

    def hosted(name: str, host: str, model: str, at: float = 1.0) -> NodeInfo:
        node = decode_node(name)
        return msgspec.structs.replace(node, model=model, hosted_models=2, host=host, timestamp=at)

    table.nodes = {
        n.node_id: n
        for n in [
            hosted("p1", "p1", "a"),
            hosted("p1-m2", "p1", "b"),
            hosted("p2", "p2", "a"),
            hosted("p2-m2", "p2", "b"),
        ]
    }
    first = table.pick_decode(2, model="a")
    assert first is not None
    second = table.pick_decode(2, model="b")
    assert second is not None and second.host != first.host
    # a's second request joins a's first (b runs on the other process)
    third = table.pick_decode(2, model="a")
    assert third is not None and third.node_id == first.node_id
    # the freshest entry of a process tells its load: p-of-first says 5 run there now
    fresh = msgspec.structs.replace(
        table.nodes[first.node_id], load=5, running=5, host_running=5, timestamp=2.0
    )
    table.put(fresh)
    table.inflight[fresh.node_id] = 0
    assert table.host_load(table.nodes[second.node_id]) == 1  # b's one, sent
    assert table.host_load(fresh) == 5
    sibling = next(n for n in table.nodes.values() if n.host == fresh.host and n is not fresh)
    assert table.host_load(sibling) == 5  # the older entry of the same process reads it too


def test_a_sequence_queued_for_its_prefill_keeps_its_process_from_looking_idle() -> None:
    """A heartbeat sent while model a's request waits for its local prefill: its node
    states it as load (not running) and its process counts it (host_running); model b's
    next request then goes to the idle process, not this one."""
    table = NodeTable(registry=None)  # type: ignore[arg-type]

    def hosted(name: str, host: str, model: str, load: int, on_host: int) -> NodeInfo:
        node = msgspec.structs.replace(decode_node(name), model=model, load=load)
        return msgspec.structs.replace(node, host_running=on_host, hosted_models=2, host=host)

    table.nodes = {
        n.node_id: n
        for n in [
            hosted("p1", "p1", "a", 0, 0),
            hosted("p1-m2", "p1", "b", 0, 0),
            hosted("p2", "p2", "a", 1, 1),  # a's request queued on process 2
            hosted("p2-m2", "p2", "b", 0, 1),
        ]
    }
    choice = table.best_decode(2, model="b")
    assert choice is not None and choice.node_id == "p1-m2"
    choice = table.best_decode(2, model="a")
    assert choice is not None and choice.node_id == "p2"  # a gathers where it queues
