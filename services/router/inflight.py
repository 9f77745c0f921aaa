"""The requests this router serves now: admission's count and the table of live streams.

Admission counts a request from the moment its body is in, before it is tokenised
(`admitted`, bounded by `--max-inflight`; `/tokenize` and `/detokenize` count too while they
wait for the tokenising thread). A stream is registered under its
client-facing id from its first journal write until it ends: the janitor leaves a
registered request alone, a resume of it on this router is refused, and when a node leaves,
every registered stream's failover hears of it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from shared.errors import RateLimitError

if TYPE_CHECKING:
    from services.router.failover import Failover


class InFlight:
    def __init__(self, max_inflight: int) -> None:
        self.max_inflight = max_inflight
        self.admitted = 0
        self.streaming: set[str] = set()  # client-facing ids of the streams this process serves
        self.failovers: dict[str, Failover] = {}  # client-facing id → its failover state

    @contextmanager
    def admit(self, count: int = 1) -> Iterator[None]:
        """Counts a request (`count`: its choices, each a sequence of its own) while the
        block runs, from once its body is in (tokenising it is work too); the caller
        checked `room()` just before."""
        self.admitted += count
        try:
            yield
        finally:
            self.admitted -= count

    def room(self) -> int:
        return self.max_inflight - self.admitted

    def check_room(self, count: int = 1) -> None:
        """A RateLimitError (429) unless `count` more fit: call just before `admit`."""
        if self.room() < count:
            raise RateLimitError("too many requests in flight; retry shortly", retry_after=1)

    def __contains__(self, rid: str) -> bool:
        return rid in self.streaming

    def claim(self, rid: str) -> None:
        """This process streams `rid` (from before its first journal write on)."""
        self.streaming.add(rid)

    def watch(self, rid: str, failover: Failover) -> None:
        """From now on a node's loss reaches this request's failover."""
        self.streaming.add(rid)
        self.failovers[rid] = failover

    def release(self, rid: str) -> None:
        self.streaming.discard(rid)
        self.failovers.pop(rid, None)

    def node_lost(self, node_id: str) -> None:
        """A node left or was declared dead: the requests it served fail over."""
        for failover in list(self.failovers.values()):
            failover.node_left(node_id)
