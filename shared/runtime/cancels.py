"""A node's reading of the broadcast `Cancel`: every prefill and decode node hears each one."""

from __future__ import annotations

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
