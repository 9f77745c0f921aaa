"""Running requests' partial last KV blocks (tails), one per request, bounded and short-lived.

A decode node extends a request's tail after every step with the rows the step added, and
replaces it when a new block starts (`shared.kv.tail`); a node resuming the request after a
failure fetches it. A piece that does not continue the stored tail (this node lost it, or
never had the start) drops what is stored: a tail is whole or absent, never wrong.

Unlike full blocks these are not shared between requests and go stale within a step, so
they live apart from the block store: keyed by request id, least recently written dropped
first past a byte bound, and each dropped `ttl` seconds after its last write, so a tail of
a request that no longer progresses is released within that lease.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

import msgspec

from shared.bus.messages import KVTail
from shared.kv.tail import continues

TAIL_TTL = 5.0  # seconds; a running request extends its tail every step


class TailStore:
    def __init__(
        self,
        max_bytes: int,
        ttl: float = TAIL_TTL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_bytes = max_bytes
        self.ttl = ttl
        self.clock = clock
        self.used_bytes = 0
        self.stored = 0
        self.served = 0
        self.dropped = 0  # pushed out by the byte bound
        self.broken = 0  # dropped for a piece that did not continue them
        self._tails: OrderedDict[str, tuple[KVTail, bytearray, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._tails)

    def continues(self, piece: KVTail) -> bool:
        """Whether `piece` can be stored: a whole tail, or rows right after the stored ones."""
        entry = self._tails.get(piece.attempt_id)
        return not piece.first or (entry is not None and continues(entry[0], piece))

    def put(self, tail: KVTail, data: bytes | memoryview) -> bool:
        """Store a whole tail (a copy of `data`) or append a piece's rows to the stored one;
        False if it could not (too large at all, or a piece not continuing it)."""
        if not self.continues(tail):
            if self._remove(tail.attempt_id):
                self.broken += 1
            return False
        entry = self._tails.pop(tail.attempt_id, None)
        if entry is not None:
            self.used_bytes -= len(entry[1])
        if tail.first and entry is not None:
            rows = entry[1]
            rows += data  # in place: no export of it outlives a call here (`get` copies)
        else:
            rows = bytearray(data)
        if len(rows) > self.max_bytes:
            return False
        while self._tails and self.used_bytes + len(rows) > self.max_bytes:
            self._remove(next(iter(self._tails)))
            self.dropped += 1
        whole = msgspec.structs.replace(tail, first=0)
        self._tails[tail.attempt_id] = (whole, rows, self.clock() + self.ttl)
        self.used_bytes += len(rows)
        self.stored += 1
        return True

    def get(self, request_id: str) -> tuple[KVTail, bytes] | None:
        """The request's whole tail and a copy of its rows (a send outlives later puts)."""
        self.expire()
        entry = self._tails.get(request_id)
        if entry is None:
            return None
        self.served += 1
        return entry[0], bytes(entry[1])

    def expire(self) -> int:
        """Drop every tail past its lease; how many."""
        now = self.clock()
        dropped = 0
        # Oldest write first, and every lease is as long: the expired ones lead.
        while self._tails and next(iter(self._tails.values()))[2] <= now:
            self._remove(next(iter(self._tails)))
            dropped += 1
        return dropped

    def _remove(self, request_id: str) -> bool:
        entry = self._tails.pop(request_id, None)
        if entry is not None:
            self.used_bytes -= len(entry[1])
        return entry is not None
