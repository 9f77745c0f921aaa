"""KV blocks in and out of an engine's pool by hash: the engine side of the kvcache service.

In: a prefill node fetches a prompt's cached prefix from kvcache and places the blocks in
its pool as cached (free, findable) blocks, so the next admission finds them like any
local hit. Out: a decode node collects the blocks its forwards fill and hands them to the
uploader between steps, before they can be reused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from shared.errors import WireFormatError
from shared.kv.block_hash import BlockHash, block_hashes

if TYPE_CHECKING:
    from shared.engine.engine import EngineConfig
    from shared.kv.block_pool import BlockPool
    from shared.kv.paged_cache import KVLayout, PagedKVCache


class BlockExchange:
    """Mixed into Engine, whose attributes these are."""

    config: EngineConfig
    layout: KVLayout
    pool: BlockPool
    cache: PagedKVCache
    hash_extra: bytes
    collect_filled: bool
    _filled: list[tuple[BlockHash, int]]
    on_blocks_named: Callable[[list[BlockHash]], None] | None

    def prompt_block_hashes(self, prompt_ids: list[int]) -> list[BlockHash]:
        """Hashes of the prompt's blocks a prefix hit could cover (≥ 1 token stays to compute)."""
        return block_hashes(prompt_ids[:-1], self.config.block_size, self.hash_extra)

    def cached_prefix_blocks(self, hashes: list[BlockHash]) -> int:
        """How many leading blocks of `hashes` this node's own pool holds."""
        return len(self.pool.cached_prefix(hashes))

    def import_cached_blocks(self, hashes: list[BlockHash], blocks: list[bytes]) -> int:
        """Place blocks fetched by hash into the pool as cached (free, findable) blocks.

        The next admission of a prompt with this prefix then finds them like any local hit.
        Returns how many were placed (none when the pool has no room to spare for them).
        """
        todo = [(h, b) for h, b in zip(hashes, blocks, strict=True) if self.pool.lookup(h) is None]
        size = self.layout.bytes_per_block
        if not todo or not self.pool.can_allocate(len(todo)):
            return 0
        if any(len(b) != size for _, b in todo):
            raise WireFormatError(f"a cached KV block is not {size} bytes")
        ids = self.pool.allocate(len(todo))
        raw = bytearray(b"".join(b for _, b in todo))
        self.cache.write_blocks(ids, self.layout.blocks_from_bytes(raw, len(todo)))
        for block_id, (h, _) in zip(ids, todo, strict=True):
            self.pool.commit_hash(block_id, h)
        self.pool.free(ids)
        return len(todo)

    def _on_commit(self, hashes: list[BlockHash], block_ids: list[int]) -> None:
        if self.on_blocks_named is not None:
            self.on_blocks_named(hashes)
        if self.collect_filled:
            self._filled.extend(zip(hashes, block_ids, strict=True))

    def take_filled_blocks(self) -> tuple[list[BlockHash], list[bytes]]:
        """Blocks filled by forwards since the last call, as (hashes, bytes per block).

        Call on the engine thread between steps: the blocks may be reused once it returns.
        """
        filled, self._filled = self._filled, []
        if not filled:
            return [], []
        data = self.cache.read_blocks([b for _, b in filled])
        raw = data.view(torch.uint8).reshape(len(filled), -1).numpy().tobytes()
        size = self.layout.bytes_per_block
        return [h for h, _ in filled], [raw[i * size : (i + 1) * size] for i in range(len(filled))]
