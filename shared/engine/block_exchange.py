"""KV blocks in and out of an engine's pool by hash: the engine side of the kvcache service.

In: a prefill node fetches a prompt's cached prefix from kvcache and places the blocks in
its pool as cached (free, findable) blocks, so the next admission finds them like any
local hit. Out: a decode node collects the blocks its forwards fill and hands them to the
uploader between steps, before they can be reused, and the partly filled last block of
each running sequence (its tail, `shared.kv.tail`: after each step only the rows it added),
so a resume elsewhere recomputes one token rather than up to a block; a resumed sequence's
tail goes back into a fresh block.
"""

from __future__ import annotations

import threading
from collections import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shared.errors import WireFormatError
from shared.kv.block_hash import ROOT_HASH, BlockHash, block_hashes
from shared.kv.tail import TailBlock, fit_tail

if TYPE_CHECKING:
    from shared.engine.engine import EngineConfig
    from shared.engine.scheduler import Scheduler
    from shared.engine.sequence import Sequence
    from shared.kv.block_pool import BlockPool
    from shared.kv.paged_cache import KVLayout, PagedKVCache


@dataclass(frozen=True)
class CheckpointPoint:
    """How far a sequence's KV is handed to the uploader: enough to resume it elsewhere."""

    request_id: str
    num_tokens: int  # positions covered by its handed-over full blocks
    block_hashes: list[BlockHash]
    output_ids: list[int]  # generated so far (with the seed: the whole sampler state)
    seed: int


class BlockExchange:
    """Mixed into Engine, whose attributes these are."""

    config: EngineConfig
    layout: KVLayout
    pool: BlockPool
    cache: PagedKVCache
    scheduler: Scheduler
    hash_extra: bytes
    collect_filled: bool
    collect_tails: bool  # take_tails returns the running sequences' partial blocks
    _tails_taken: dict[str, tuple[int, int, int]]  # request id → (start, block id, rows)
    _tails_resend: set[str]  # requests whose next tail is taken whole (any thread adds)
    _tails_lock: threading.Lock
    checkpoint_every: int  # filled blocks per sequence handed over together (the cadence)
    _filled: list[tuple[BlockHash, int]]
    # request id → (sequence, [(block index, hash, block id)]) filled, not yet handed over
    _pending: dict[str, tuple[Sequence, list[tuple[int, BlockHash, int]]]]
    _points: dict[str, CheckpointPoint]
    on_blocks_named: Callable[[list[BlockHash]], None] | None

    def prompt_block_hashes(self, prompt_ids: list[int]) -> list[BlockHash]:
        """Hashes of the prompt's blocks a prefix hit could cover (≥ 1 token stays to compute)."""
        return block_hashes(prompt_ids[:-1], self.config.block_size, self.hash_extra)

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
        if self.on_blocks_named is not None:  # this pool holds them now: routers may use it
            self.on_blocks_named([h for h, _ in todo])
        return len(todo)

    def _on_commit(
        self, seq: Sequence, start: int, hashes: list[BlockHash], ids: list[int]
    ) -> None:
        if self.on_blocks_named is not None:
            self.on_blocks_named(hashes)
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
        covered = (items[-1][0] + 1) * self.config.block_size
        self._points[seq.request_id] = CheckpointPoint(
            seq.request_id, covered, list(seq.block_hashes[: items[-1][0] + 1]),
            list(seq.output_ids), seq.seed,
        )  # fmt: skip

    def _sequence_ended(self, seq: Sequence, finished: bool) -> None:
        """A finished sequence's blocks go out now (intact until the next step allocates);
        an aborted one's may be reused before the next take: dropped."""
        if finished:
            self._hand_over(seq, point=False)
        else:
            self._pending.pop(seq.request_id, None)
        self._tails_taken.pop(seq.request_id, None)

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
        return [h for h, _ in filled], self._block_bytes([b for _, b in filled])

    def _block_bytes(self, block_ids: list[int]) -> list[memoryview]:
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

    def take_tails(self) -> list[TailBlock]:
        """What grew of every running sequence's partly filled last block since the last
        call: the rows added since (a piece), or all of them when the sequence is new
        here, entered a new block or `resend_tails` named it. Nothing for a sequence whose
        KV ends on a block boundary: its full blocks say all.

        Call on the engine thread between steps, like `take_filled_blocks`.
        """
        if not self.collect_tails:
            return []
        with self._tails_lock:
            resend, self._tails_resend = self._tails_resend, set()
        bs = self.config.block_size
        found: list[tuple[Sequence, int, int]] = []
        for seq in self.scheduler.running:
            computed = seq.num_computed
            start = computed - computed % bs
            index = start // bs
            if (
                computed == start
                or len(seq.block_hashes) < index  # unnamed (no prefix caching)
                or len(seq.block_ids) <= index
            ):
                continue
            taken = (start, seq.block_ids[index], computed - start)
            before = self._tails_taken.get(seq.request_id)
            if before == taken and seq.request_id not in resend:
                continue
            self._tails_taken[seq.request_id] = taken
            grew = before is not None and before[:2] == taken[:2] and before[2] < taken[2]
            first = before[2] if before and grew and seq.request_id not in resend else 0
            found.append((seq, start, first))
        if not found:
            return []
        spans = [
            (s.block_ids[start // bs], first, s.num_computed - start) for s, start, first in found
        ]
        rows = self.cache.read_slots(spans)
        raw = rows.view(torch.uint8).reshape(-1).numpy().data
        row = self.layout.bytes_per_slot
        tails, at = [], 0
        for (seq, start, first), (_, _, end) in zip(found, spans, strict=True):
            tails.append(
                TailBlock(
                    seq.request_id,
                    start,
                    seq.block_hashes[start // bs - 1] if start else ROOT_HASH,
                    seq.all_ids[start : seq.num_computed],
                    raw[at * row : (at + end - first) * row],
                    first,
                )
            )
            at += end - first
        return tails

    def resend_tails(self, request_ids: list[str]) -> None:
        """The store lost these requests' tails: take them whole next time (any thread)."""
        with self._tails_lock:
            self._tails_resend.update(request_ids)

    def fit_tail(self, tail: TailBlock, context: list[int]) -> TailBlock | None:
        """The part of a stored tail a resume of `context` can use (None: unusable)."""
        bs = self.config.block_size
        if len(tail.data) != tail.rows * self.layout.bytes_per_slot:
            return None
        hashes = block_hashes(context[: tail.start], bs, self.hash_extra)
        return fit_tail(tail, context, hashes, bs)

    def _place_tail(self, seq: Sequence) -> None:
        """At admission: a resumed sequence's tail goes into the block after its cached
        prefix, if that prefix reaches exactly to it; its tokens then count as computed."""
        tail, seq.tail = seq.tail, None
        if tail is None:
            return
        index = tail.start // self.config.block_size
        if seq.num_computed != tail.start or len(seq.block_ids) <= index:
            return  # the prefix hit ended elsewhere: the tokens are recomputed
        self.cache.write_slots(seq.block_ids[index], 0, tail.data)
        seq.num_computed += len(tail.token_ids)
        seq.num_cached_tokens = max(seq.num_cached_tokens, seq.num_computed)
