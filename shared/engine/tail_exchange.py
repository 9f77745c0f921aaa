"""Running sequences' partly filled last blocks (tails, `shared.kv.tail`) out of an engine's
cache and back into it: the engine side of tail checkpoints.

Out: after each step a decode node takes the rows each running sequence added to its tail,
so a resume elsewhere recomputes one token rather than up to a block. In: a resumed
sequence's stored tail goes back into the fresh block after its cached prefix.
"""

from __future__ import annotations

import threading

import torch

from shared.engine.scheduler import Scheduler
from shared.engine.sequence import Sequence
from shared.kv.block_hash import block_hashes, chain_root
from shared.kv.paged_cache import KVLayout, PagedKVCache
from shared.kv.tail import TailBlock, fit_tail


class TailExchange:
    """An engine's part: its running sequences' tails, taken after steps and placed back."""

    def __init__(
        self, layout: KVLayout, cache: PagedKVCache, scheduler: Scheduler, hash_extra: bytes
    ) -> None:
        self.layout = layout
        self.cache = cache
        self.scheduler = scheduler  # whose running sequences' tails `take` reads
        self.hash_extra = hash_extra
        self.collect = False  # `take` returns the running sequences' tails (else nothing)
        self._taken: dict[str, tuple[int, int, int]] = {}  # request id → (start, block id, rows)
        self._resend: set[str] = set()  # requests whose next tail is taken whole
        self._lock = threading.Lock()  # `resend` may be called from any thread

    def take(self) -> list[TailBlock]:
        """What grew of every running sequence's partly filled last block since the last
        call: the rows added since (a piece), or all of them when the sequence is new
        here, entered a new block or `resend` named it. Nothing for a sequence whose
        KV ends on a block boundary: its full blocks say all.

        Call on the engine thread between steps, like `take_filled_blocks`.
        """
        if not self.collect:
            return []
        with self._lock:
            resend, self._resend = self._resend, set()
        found = self._grown(resend)
        if not found:
            return []
        return self._read(found)

    def _grown(self, resend: set[str]) -> list[tuple[Sequence, int, int]]:
        """(sequence, tail start, first row not taken yet) of each tail that grew."""
        bs = self.layout.block_size
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
            before = self._taken.get(seq.request_id)
            if before == taken and seq.request_id not in resend:
                continue
            self._taken[seq.request_id] = taken
            grew = before is not None and before[:2] == taken[:2] and before[2] < taken[2]
            first = before[2] if before and grew and seq.request_id not in resend else 0
            found.append((seq, start, first))
        return found

    def _read(self, found: list[tuple[Sequence, int, int]]) -> list[TailBlock]:
        """The rows of these tails, from the cache in one read (views into it)."""
        bs = self.layout.block_size
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
                    seq.block_hashes[start // bs - 1]
                    if start
                    else chain_root(seq.params.cache_salt),
                    seq.all_ids[start : seq.num_computed],
                    raw[at * row : (at + end - first) * row],
                    first,
                )
            )
            at += end - first
        return tails

    def resend(self, request_ids: list[str]) -> None:
        """The store lost these requests' tails: take them whole next time (any thread)."""
        with self._lock:
            self._resend.update(request_ids)

    def forget(self, request_id: str) -> None:
        """The sequence ended here: nothing of it is taken any more."""
        self._taken.pop(request_id, None)

    def fit(self, tail: TailBlock, context: list[int], cache_salt: str = "") -> TailBlock | None:
        """The part of a stored tail a resume of `context` can use (None: unusable)."""
        bs = self.layout.block_size
        if len(tail.data) != tail.rows * self.layout.bytes_per_slot:
            return None
        root = chain_root(cache_salt)
        hashes = block_hashes(context[: tail.start], bs, self.hash_extra, parent=root)
        return fit_tail(tail, context, hashes, bs, root)

    def place(self, seq: Sequence) -> None:
        """At admission: a resumed sequence's tail goes into the block after its cached
        prefix, if that prefix reaches exactly to it; its tokens then count as computed."""
        tail, seq.tail = seq.tail, None
        if tail is None:
            return
        index = tail.start // self.layout.block_size
        if seq.num_computed != tail.start or len(seq.block_ids) <= index:
            return  # the prefix hit ended elsewhere: the tokens are recomputed
        self.cache.write_slots(seq.block_ids[index], 0, tail.data)
        seq.num_computed += len(tail.token_ids)
        seq.num_cached_tokens = max(seq.num_cached_tokens, seq.num_computed)
