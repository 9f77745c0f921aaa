"""Running requests' partial last KV blocks (tails), one per request, bounded and short-lived.

A decode node replaces a request's tail after every step (`shared.kv.tail`); a node resuming
the request after a failure fetches it. Unlike full blocks these are not shared between
requests and go stale within a step, so they live apart from the block store: keyed by
request id, least recently written dropped first past a byte bound, and each dropped
`ttl` seconds after its last write, so a tail of a request that no longer progresses is
released within that lease.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from shared.bus.messages import KVTail

TAIL_TTL = 5.0  # seconds; a running request rewrites its tail every step


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
        self._tails: OrderedDict[str, tuple[KVTail, bytes, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._tails)

    def put(self, tail: KVTail, data: bytes | memoryview) -> bool:
        """Replace the request's tail (a copy of `data`); False if it cannot fit at all."""
        self._remove(tail.request_id)
        if len(data) > self.max_bytes:
            return False
        while self._tails and self.used_bytes + len(data) > self.max_bytes:
            self._remove(next(iter(self._tails)))
            self.dropped += 1
        self._tails[tail.request_id] = (tail, bytes(data), self.clock() + self.ttl)
        self.used_bytes += len(data)
        self.stored += 1
        return True

    def get(self, request_id: str) -> tuple[KVTail, bytes] | None:
        self.expire()
        entry = self._tails.get(request_id)
        if entry is None:
            return None
        self.served += 1
        return entry[0], entry[1]

    def expire(self) -> int:
        """Drop every tail past its lease; how many."""
        now = self.clock()
        dropped = 0
        # Oldest write first, and every lease is as long: the expired ones lead.
        while self._tails and next(iter(self._tails.values()))[2] <= now:
            self._remove(next(iter(self._tails)))
            dropped += 1
        return dropped

    def _remove(self, request_id: str) -> None:
        entry = self._tails.pop(request_id, None)
        if entry is not None:
            self.used_bytes -= len(entry[1])
