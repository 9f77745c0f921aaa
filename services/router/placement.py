"""Where a request runs first: the router's plan for it, from its view of the cluster
(the node table, KV-aware routing) alone. A module of its own, free of the HTTP side, so
that `tandem plan simulate` routes its simulated requests with this same code (and
compiles it with the rest of its hot path, tandem/plan/compiled.py)."""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry import trace

from services.router.nodes import NodeTable, prefill_pool
from services.router.routing import PrefixRouter, RoutePlan
from shared.bus.ids import RequestId
from shared.bus.messages import NodeInfo
from shared.errors import CapacityError


@dataclass
class Plan:
    """Where a request runs first."""

    blocks: int
    decode_node: NodeInfo
    local: bool  # the decode node holds the prefix: try prefilling there
    prefix: RoutePlan | None  # what KV-aware routing found
    model: str = ""  # the nodes it was chosen among serve this model ("": any)


def plan(
    nodes: NodeTable,
    routing: PrefixRouter | None,
    prompt_ids: list[int],
    max_tokens: int,
    span: trace.Span = trace.INVALID_SPAN,
    cache_salt: str = "",
    model: str = "",
) -> Plan:
    """Where a request runs first (among the nodes of `model`, if named). A function of
    the router's view of the cluster only, so `tandem plan simulate` routes its simulated
    requests with this same code."""
    blocks = nodes.blocks_needed(len(prompt_ids), max_tokens, model)
    prefix = routing.plan(prompt_ids, blocks, cache_salt, model) if routing else None
    local_node = prefix.local_node if prefix is not None else None
    if local_node is not None:  # counted as sent, as pick_decode counts its choice
        nodes.sent(local_node.node_id)
    decode_node = local_node or nodes.pick_decode(blocks, model=model)
    if prefix is not None:
        span.set_attribute("tandem.decode_cached_tokens", prefix.decode_cached_tokens)
        span.set_attribute("tandem.kvcache_cached_tokens", prefix.kvcache_cached_tokens)
    if decode_node is None:
        raise CapacityError("no decode node has room for this request", retry_after=2)
    return Plan(blocks, decode_node, local_node is not None, prefix, model)


def check_pool(nodes: NodeTable, model: str) -> None:
    """A request no decode node prefills itself needs a prefill pool: a colocated router,
    or a conditional one whose pool is scaled to none, answers 503 instead of queueing a
    job no node reads."""
    if nodes.pool_less(model):
        raise CapacityError("no decode node took the request; retry shortly", retry_after=1)


def after_local_refusal(nodes: NodeTable, refused: NodeInfo, blocks: int, model: str) -> NodeInfo:
    """The decode node a request goes to, the usual way, when the one chosen to prefill it
    locally (a plan, or a failover's target) refused: another with room if there is one (a
    late cancel of the refused attempt, which timed out, must not meet the request there
    again), else that same node. The refused node was counted when chosen: the count moves
    with the request."""
    nodes.sent(refused.node_id, -1)
    node = nodes.pick_decode(blocks, {refused.node_id}, model=model)
    return node or refused


def track_backlog(nodes: NodeTable, rid: RequestId, where: Plan, route: str, prompt: int) -> None:
    """Count its prompt (what will be computed of it) as queued for a prefill where it
    went, until its first token (relay.py) or its end."""
    prefix = where.prefix
    if route == "local":
        cached = prefix.decode_cached_tokens if prefix is not None and prefix.local_node else 0
        nodes.prefill_sent(rid, where.decode_node.node_id, prompt - cached)
    else:
        held = max(prefix.kvcache_cached_tokens, prefix.prefill_cached_tokens) if prefix else 0
        nodes.prefill_sent(rid, prefill_pool(where.model), prompt - held)
