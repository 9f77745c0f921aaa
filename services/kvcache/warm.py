"""Warm connections: a one-byte transfer, on request, over the connection gets will take.

A get's blocks travel from the kvcache node to the asking node's data-plane listener, so
the first get from a node pays for the connection (~0.1 s with UCX on these machines), and
a failover's checkpoint load on a node that never loaded a prefix is exactly such a first
get. So the prefill and decode nodes ask each kvcache node to warm a connection to them
(`shared.kvclient.warm`), naming a transfer id and secret they expect: the kvcache node
sends one byte under them over its pooled connection, which stays pooled for the gets.

Why a transfer and not just a connection opened ahead of need (as this node once did): a
listener cannot tell a silent connection of a peer from a stranger's, so it had to let
every silent connection idle until a first transfer might come (30 s). A connection that
carries an admitted transfer at once is proven (`shared/transport/admission.py`), and
strangers need no longer be given time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from nats.aio.msg import Msg

from services.kvcache.peers import NOT_A_PEER
from shared.bus.client import Bus
from shared.bus.messages import KVWarm, accepted, decode, refused
from shared.errors import WireFormatError
from shared.transport.base import TransferError, Transport
from shared.transport.frames import make_header

log = logging.getLogger("tandem.kvcache")

WARM_TIMEOUT = 5.0  # connect and send one byte
MAX_WARMING = 64  # warm transfers at once; beyond, a request is refused (asked again later)
MAX_FIELD = 256  # transfer ids and addresses are short; a long one is no node's
PAYLOAD = memoryview(b"\x00")


class WarmSender:
    """Answers `tandem.kvcache.<node>.warm` requests (KVWarm)."""

    def __init__(
        self,
        bus: Bus,
        transport: Transport,
        may_send_to: Callable[[str, str], Awaitable[bool]] | None = None,
    ) -> None:
        """`may_send_to(address, subject)`: whether it may send there (the worker's check
        against the registry); None: anywhere."""
        self.bus = bus
        self.transport = transport
        self.may_send_to = may_send_to
        self.sent = 0
        self.failed = 0
        self._tasks: set[asyncio.Task[None]] = set()

    async def on_warm(self, msg: Msg) -> None:
        try:
            warm = decode(msg.data, KVWarm)
            if not warm.transfer_id or not warm.reply_address or not warm.transfer_secret:
                raise WireFormatError("warm needs a transfer id, a reply address and a secret")
            if max(len(warm.transfer_id), len(warm.reply_address)) > MAX_FIELD:
                raise WireFormatError("transfer id or reply address too long")
        except WireFormatError as exc:
            self.bus.count_drop(msg.subject, str(exc))
            await msg.respond(refused(str(exc)))
            return
        if self.may_send_to is not None and not await self.may_send_to(
            warm.reply_address, msg.subject
        ):
            await msg.respond(refused(NOT_A_PEER))
            return
        if len(self._tasks) >= MAX_WARMING:
            self.bus.count_drop(msg.subject, "too many warm transfers at once")
            await msg.respond(refused("busy; ask again later"))
            return
        await msg.respond(accepted())
        task = asyncio.create_task(self._send(warm))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, warm: KVWarm) -> None:
        header = make_header("kvcache-warm", warm.transfer_id, PAYLOAD, secret=warm.transfer_secret)
        try:
            await self.transport.send(warm.reply_address, header, PAYLOAD, timeout=WARM_TIMEOUT)
            self.sent += 1
        except TransferError as exc:  # the asker times out and asks again later
            self.failed += 1
            log.debug("warm transfer to %s failed: %s", warm.reply_address, exc)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
