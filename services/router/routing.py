"""KV-aware routing: where a request's prompt prefix already lives, and what that saves.

The router hashes each prompt's blocks exactly as the nodes do (block size and hash key
come from the decode nodes' registry entries) and looks them up in the KV-event index:

- a decode node whose own pool holds all but a short tail of the prompt (at most
  `local_max_tokens` uncached) gets the request directly and prefills that tail itself:
  no prefill queue, no KV transfer; the few tokens it computes barely delay its running
  streams (the reason to disaggregate is long prompts, and this one is short in effect);
- otherwise the request takes the disaggregated path: a prefill node computes what it and
  the kvcache service do not hold (it loads the rest) and the decode node is chosen by load.
  Which prefill node is a cost: uncached tokens to compute, plus tokens to load from
  kvcache (each ~LOAD_COST of computing one), plus QUEUE_COST for each job it already has.
  When a prefill node's own pool holds part of the prompt and that makes it cheaper than
  the shared queue's first free node by STEER_MARGIN, the job is steered to it (its own
  queue); otherwise it goes to the shared queue, where the first free node takes it.

With conditional disaggregation (`tandem router --conditional`, conditional.py), a request
the rule above would send to the prefill pool may still be prefilled on a decode node
(chunked beside its streams) when the costs say its first token comes sooner there.

In colocated mode (`tandem router --colocated`, no prefill nodes) every request takes the
local path: to the decode node holding the most of its prompt, else to the least loaded
one, which prefills the whole prompt itself, in the same engine as its running decodes.

Expected cached tokens for both paths are reported on the admission span and in metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from services.router.conditional import Backlog, PrefillPathChooser
from services.router.nodes import NodeTable, prefill_pool
from shared.bus.kv_events import KVIndex
from shared.bus.messages import NodeInfo
from shared.kv.block_hash import block_hashes, chain_root

# Loading a token's KV from kvcache costs this share of computing it: benchmarks/prefix.py,
# 1,800 of 2,000 tokens cached: 0.22x cold TTFT loaded from kvcache, 0.17x from the pool.
LOAD_COST = 0.06
QUEUE_COST = 256  # tokens of work a prefill node is expected to have per job it holds
STEER_MARGIN = 32  # tokens a steered job must save over the shared queue


@dataclass
class RoutePlan:
    local_node: NodeInfo | None  # prefill on this decode node (its pool holds the prefix)
    decode_cached_tokens: int  # the longest prefix any decode node's pool holds
    kvcache_cached_tokens: int  # prefix the kvcache nodes hold, for the disaggregated path
    prompt_tokens: int
    prefill_node: NodeInfo | None = None  # steer the job here (its pool holds the prefix)
    prefill_cached_tokens: int = 0  # what that node's pool holds of the prompt
    reason: str = ""  # why this path (logged at debug level, on the request's span)
    model: str = ""  # the served model it is for: only its nodes are candidates


class PrefixRouter:
    def __init__(
        self,
        nodes: NodeTable,
        index: KVIndex,
        local_max_tokens: int = 96,
        colocated: bool = False,
        chooser: PrefillPathChooser | None = None,
    ) -> None:
        self.nodes = nodes
        self.index = index
        self.local_max_tokens = local_max_tokens
        self.colocated = colocated
        self.chooser = chooser  # conditional disaggregation, when set

    def plan(
        self, prompt_ids: list[int], blocks_needed: int, cache_salt: str = "", model: str = ""
    ) -> RoutePlan:
        """Where a prompt (for `model`: its nodes alone) is best prefilled and decoded."""
        decoders = self.nodes.by_role("decode", model)
        kvcache = [n.node_id for n in self.nodes.by_role("kvcache")]
        plan = RoutePlan(None, 0, 0, len(prompt_ids), model=model)
        if not decoders:
            return plan
        hashes_by_key: dict[tuple[str, int], list[bytes]] = {}

        def hashes_for(node: NodeInfo) -> list[bytes] | None:
            if not node.hash_key or node.block_size <= 0:
                return None
            if not self.index.by_node:
                return None  # no node holds a block: no prefix to find (hashing is the cost)
            key = (node.hash_key, node.block_size)
            if key not in hashes_by_key:
                # As the engine does: the last prompt token is always computed.
                extra, root = node.hash_key.encode(), chain_root(cache_salt)
                hashes_by_key[key] = list(
                    block_hashes(prompt_ids[:-1], node.block_size, extra, parent=root)
                )
            return hashes_by_key[key]

        best: tuple[int, float, str] | None = None
        # No node holds a block (the index is empty): no prefix to find on any of them.
        for node in decoders if self.index.by_node else ():
            hashes = hashes_for(node)
            if hashes is None:
                continue
            cached = self.index.prefix_blocks(node.node_id, hashes) * node.block_size
            plan.kvcache_cached_tokens = max(
                plan.kvcache_cached_tokens,
                self.index.union_prefix_blocks(kvcache, hashes) * node.block_size,
            )
            room = node.free_kv_blocks >= blocks_needed
            if cached == 0 or not room:
                continue
            uncached = len(prompt_ids) - cached
            score = (uncached, node.running / max(1, node.total_kv_blocks), node.node_id)
            if best is None or score < best:
                best = score
                plan.local_node, plan.decode_cached_tokens = node, cached
        if self.colocated:  # there is no other path: any uncached tail is prefilled locally
            if plan.local_node is None:
                plan.local_node = self.nodes.best_decode(blocks_needed, model=model)
            plan.reason = "colocated"
        elif best is None or best[0] > self.local_max_tokens:
            holder, plan.local_node = plan.local_node, None
            if self.chooser is None or not self._conditional(plan, blocks_needed, holder):
                self._steer(plan, hashes_for)
        else:
            plan.reason = f"{best[0]} tokens uncached on {best[2]}"
        return plan

    def _conditional(self, plan: RoutePlan, blocks_needed: int, holder: NodeInfo | None) -> bool:
        """Prefill locally after all, if the costs say so (conditional.py): on the decode
        node holding the longest prefix, else on the one with the most room. Whether it
        chose to (then `plan.local_node` is set)."""
        assert self.chooser is not None
        node = holder or self.nodes.best_decode(blocks_needed, model=plan.model)
        if node is None or self.nodes.room(node, blocks_needed) < blocks_needed:
            plan.reason = "no decode node has room to prefill locally"
            return False
        cached = plan.decode_cached_tokens if holder is not None else 0
        remote = plan.prompt_tokens - plan.kvcache_cached_tokens
        backlog = Backlog(
            pool_tokens=self.nodes.backlog_tokens(prefill_pool(plan.model)),
            prefill_nodes=len(self.nodes.by_role("prefill", plan.model)),
            local_tokens=self.nodes.backlog_tokens(node.node_id),
        )
        choice = self.chooser.choose(
            plan.prompt_tokens - cached, remote, plan.prompt_tokens, node, backlog
        )
        plan.reason = choice.reason
        if choice.local:
            plan.local_node, plan.decode_cached_tokens = node, cached
        return choice.local

    def _steer(self, plan: RoutePlan, hashes_for: Callable[[NodeInfo], list[bytes] | None]) -> None:
        """Pick the prefill node whose pool makes the job cheapest, if that beats the shared
        queue (see the module docstring)."""
        prefill = self.nodes.by_role("prefill", plan.model)
        if not prefill or not self.index.by_node:
            return  # no node holds a block: nothing to steer by
        n, remote = plan.prompt_tokens, plan.kvcache_cached_tokens
        queued = {p.node_id: p.load + self.nodes.inflight.get(p.node_id, 0) for p in prefill}
        shared = (n - remote) + LOAD_COST * remote + QUEUE_COST * min(queued.values())
        best: tuple[float, str] | None = None
        for node in prefill:
            hashes = hashes_for(node)
            if hashes is None:
                continue
            local = self.index.prefix_blocks(node.node_id, hashes) * node.block_size
            if local == 0:
                continue
            cached = max(local, remote)
            cost = (n - cached) + LOAD_COST * max(0, remote - local)
            cost += QUEUE_COST * queued[node.node_id]
            if cost + STEER_MARGIN < shared and (best is None or (cost, node.node_id) < best):
                best = (cost, node.node_id)
                plan.prefill_node, plan.prefill_cached_tokens = node, local
