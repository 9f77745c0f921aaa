"""KV-aware routing: where a request's prompt prefix already lives, and what that saves.

The router hashes each prompt's blocks exactly as the nodes do (block size and hash key
come from the decode nodes' registry entries) and looks them up in the KV-event index:

- a decode node whose own pool holds all but a short tail of the prompt (at most
  `local_max_tokens` uncached) gets the request directly and prefills that tail itself:
  no prefill queue, no KV transfer; the few tokens it computes barely delay its running
  streams (the reason to disaggregate is long prompts, and this one is short in effect);
- otherwise the request takes the disaggregated path: a prefill node computes what the
  kvcache service does not hold (it loads the rest) and the decode node is chosen by load.

In colocated mode (`tandem router --colocated`, no prefill nodes) every request takes the
local path: to the decode node holding the most of its prompt, else to the least loaded
one, which prefills the whole prompt itself, in the same engine as its running decodes.

Expected cached tokens for both paths are reported on the admission span and in metrics.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.router.nodes import NodeTable
from shared.bus.kv_events import KVIndex
from shared.bus.messages import NodeInfo
from shared.kv.block_hash import block_hashes


@dataclass
class RoutePlan:
    local_node: NodeInfo | None  # prefill on this decode node (its pool holds the prefix)
    decode_cached_tokens: int  # the longest prefix any decode node's pool holds
    kvcache_cached_tokens: int  # prefix the kvcache nodes hold, for the disaggregated path
    prompt_tokens: int


class PrefixRouter:
    def __init__(
        self, nodes: NodeTable, index: KVIndex, local_max_tokens: int = 96, colocated: bool = False
    ) -> None:
        self.nodes = nodes
        self.index = index
        self.local_max_tokens = local_max_tokens
        self.colocated = colocated

    def plan(self, prompt_ids: list[int], blocks_needed: int) -> RoutePlan:
        decoders = self.nodes.by_role("decode")
        kvcache = [n.node_id for n in self.nodes.by_role("kvcache")]
        plan = RoutePlan(None, 0, 0, len(prompt_ids))
        if not decoders:
            return plan
        hashes_by_key: dict[tuple[str, int], list[bytes]] = {}
        best: tuple[int, float, str] | None = None
        for node in decoders:
            key = (node.hash_key, node.block_size)
            if not node.hash_key or node.block_size <= 0:
                continue
            if key not in hashes_by_key:
                # As the engine does: the last prompt token is always computed.
                hashes_by_key[key] = list(
                    block_hashes(prompt_ids[:-1], node.block_size, node.hash_key.encode())
                )
            hashes = hashes_by_key[key]
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
                plan.local_node = self.nodes.best_decode(blocks_needed)
        elif best is None or best[0] > self.local_max_tokens:
            plan.local_node = None
        return plan
