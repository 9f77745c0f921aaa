"""A node's reading of the broadcast `Cancel`: every prefill and decode node hears each one."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from nats.aio.msg import Msg

from shared.bus.client import Bus
from shared.bus.messages import Cancel, decode
from shared.errors import WireFormatError


def read_cancel(bus: Bus, msg: Msg, node_id: str) -> Cancel | None:
    """The cancel in `msg` if it concerns this node; None if malformed (counted as a drop)
    or meant for one other node (a failover leaving it: the request goes on here)."""
    try:
        cancel = decode(msg.data, Cancel)
    except WireFormatError as exc:
        bus.count_drop(msg.subject, str(exc))
        return None
    if cancel.node_id and cancel.node_id != node_id:
        return None
    return cancel


class RecentCancels:
    """Attempt ids heard cancelled in the last `keep` seconds, at most `limit` of them: a
    job that arrives after its cancel (the queue is slower than the broadcast) is dropped.

    Kept in arrival order, so forgetting the expired ones looks only at the oldest: each
    cancel costs O(1), where rescanning the whole table on each made a storm of client
    disconnects quadratic. Past `limit` the oldest are forgotten early (a job that late
    is past its deadline anyway, or its decode node refuses it)."""

    def __init__(
        self, keep: float = 600.0, limit: int = 100_000, clock: Callable[[], float] = time.time
    ) -> None:
        self.keep = keep
        self.limit = limit
        self.clock = clock
        self._heard: OrderedDict[str, float] = OrderedDict()

    def add(self, attempt_id: str) -> None:
        now = self.clock()
        self._heard.pop(attempt_id, None)
        self._heard[attempt_id] = now
        cutoff = now - self.keep
        while self._heard and (
            len(self._heard) > self.limit or next(iter(self._heard.values())) < cutoff
        ):
            self._heard.popitem(last=False)

    def __contains__(self, attempt_id: object) -> bool:
        return attempt_id in self._heard

    def __len__(self) -> int:
        return len(self._heard)
