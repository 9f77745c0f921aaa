"""KV blocks in and out of an engine's pool by hash: the engine side of the kvcache service.

In: a prefill node fetches a prompt's cached prefix from kvcache and places the blocks in
its pool as cached (free, findable) blocks, so the next admission finds them like any
local hit. Out: a decode node collects the blocks its forwards fill and hands them to the
uploader between steps, before they can be reused. (The partly filled last blocks go their
own way: `shared.engine.tail_exchange`.)
"""

from __future__ import annotations

from collections import abc
from collections.abc import Callable

import torch

from shared.engine.sequence import Sequence
from shared.engine.types import CheckpointPoint
from shared.errors import WireFormatError
from shared.kv.block_hash import BlockHash, block_hashes, chain_root
from shared.kv.block_pool import BlockPool
from shared.kv.paged_cache import KVLayout, PagedKVCache


class BlockExchange:
    """An engine's part: its pool's full blocks, in by hash and out once filled."""

    def __init__(
        self, layout: KVLayout, pool: BlockPool, cache: PagedKVCache, hash_extra: bytes
    ) -> None:
        self.layout = layout
        self.pool = pool
        self.cache = cache
        self.hash_extra = hash_extra
        # Filled blocks are collected only while someone takes them (a checkpointing node).
        self.collect_filled = False
        self.checkpoint_every = 1  # filled blocks per sequence handed over together
        self._filled: list[tuple[BlockHash, int]] = []
        # request id → (sequence, [(block index, hash, block id)]) filled, not yet handed over
        self._pending: dict[str, tuple[Sequence, list[tuple[int, BlockHash, int]]]] = {}
        self._points: dict[str, CheckpointPoint] = {}
        # Told (on the engine thread) of hashes this pool now holds, for KV events.
        self.on_blocks_named: Callable[[list[BlockHash]], None] | None = None

    def named(self, hashes: list[BlockHash]) -> None:
        """This pool holds these blocks now: routers may send their prefixes here."""
        if self.on_blocks_named is not None and hashes:
            self.on_blocks_named(hashes)

    def prompt_block_hashes(self, prompt_ids: list[int], cache_salt: str = "") -> list[BlockHash]:
        """Hashes of the prompt's blocks a prefix hit could cover (≥ 1 token stays to compute)."""
        return self.context_block_hashes(prompt_ids[:-1], cache_salt)

    def context_block_hashes(self, token_ids: list[int], cache_salt: str = "") -> list[BlockHash]:
        """Hashes of every full block of `token_ids` (a prompt's, as a prefill computed it)."""
        root = chain_root(cache_salt)
        return block_hashes(token_ids, self.layout.block_size, self.hash_extra, parent=root)

    def cached_prefix_blocks(self, hashes: list[BlockHash]) -> int:
        """How many leading blocks of `hashes` this node's own pool holds."""
        return len(self.pool.cached_prefix(hashes))

    def import_cached_blocks(
        self, hashes: list[BlockHash], blocks: abc.Sequence[bytes | memoryview]
    ) -> int:
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
        # Straight from the buffers they arrived in (views): one copy, into the cache.
        self.cache.write_block_buffers(ids, [b for _, b in todo])
        for block_id, (h, _) in zip(ids, todo, strict=True):
            self.pool.commit_hash(block_id, h)
        self.pool.free(ids)
        self.named([h for h, _ in todo])
        return len(todo)

    def on_commit(self, seq: Sequence, start: int, hashes: list[BlockHash], ids: list[int]) -> None:
        """The scheduler named a sequence's newly filled blocks."""
        self.named(hashes)
        if self.collect_filled:
            items = self._pending.setdefault(seq.request_id, (seq, []))[1]
            items.extend(zip(range(start, start + len(hashes)), hashes, ids, strict=True))
            if len(items) >= self.checkpoint_every:
                self._hand_over(seq)

    def _hand_over(self, seq: Sequence, point: bool = True) -> None:
        """Move a sequence's pending filled blocks to the batch the next take returns (and,
        while it runs, a point saying how far its handed-over KV reaches)."""
        _, items = self._pending.pop(seq.request_id, (seq, []))
        if not items:
            return
        self._filled.extend((h, block_id) for _, h, block_id in items)
        if not point:
            return
        covered = (items[-1][0] + 1) * self.layout.block_size
        self._points[seq.request_id] = CheckpointPoint(
            seq.request_id, covered, list(seq.block_hashes[: items[-1][0] + 1]),
            list(seq.output_ids),
        )  # fmt: skip

    def sequence_ended(self, seq: Sequence, finished: bool) -> None:
        """A finished sequence's blocks go out now (intact until the next step allocates);
        an aborted one's may be reused before the next take: dropped."""
        if finished:
            self._hand_over(seq, point=False)
        else:
            self._pending.pop(seq.request_id, None)

    def take_filled_blocks(self) -> tuple[list[BlockHash], list[memoryview]]:
        """Blocks handed over since the last call (every `checkpoint_every` blocks of a
        sequence, and at its end), as (hashes, bytes per block).

        Call on the engine thread between steps: the blocks may be reused once it returns.
        """
        for rid, (seq, items) in list(self._pending.items()):
            # A preempted sequence gave its blocks back: what is pending is gone.
            if any(i >= len(seq.block_ids) or seq.block_ids[i] != b for i, _, b in items):
                del self._pending[rid]
        filled, self._filled = self._filled, []
        if not filled:
            return [], []
        return [h for h, _ in filled], self.block_bytes([b for _, b in filled])

    def block_bytes(self, block_ids: list[int]) -> list[memoryview]:
        """A copy of each block, as the bytes the kvcache service stores: views into one
        read (no further copies: this runs on the engine thread between steps)."""
        data = self.cache.read_blocks(block_ids)
        raw = data.view(torch.uint8).reshape(-1).numpy().data
        size = self.layout.bytes_per_block
        return [raw[i * size : (i + 1) * size] for i in range(len(block_ids))]

    def take_checkpoint_points(self) -> list[CheckpointPoint]:
        """Per sequence, how far the blocks handed over so far reach (latest only)."""
        points, self._points = list(self._points.values()), {}
        return points
