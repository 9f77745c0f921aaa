"""A ReceiveHandler for transfers a node asked for: each expected id resolves a future."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from shared.buffers import uninitialised
from shared.transport.base import ReceiveHandler, TransferRejected
from shared.transport.frames import TransferHeader, secret_matches


@dataclass
class _Expected:
    max_bytes: int
    deadline: float
    secret: str
    future: asyncio.Future[memoryview]


class PendingTransfers:
    """Accepts only announced transfer ids, within their deadline and size."""

    def __init__(self) -> None:
        self.expected: dict[str, _Expected] = {}
        self.refused = 0

    def expect(
        self, transfer_id: str, max_bytes: int, timeout: float, secret: str
    ) -> asyncio.Future[memoryview]:
        """Accept transfer `transfer_id` once, carrying `secret`, of at most `max_bytes`;
        the future gets the received buffer itself (no copy)."""
        future: asyncio.Future[memoryview] = asyncio.get_running_loop().create_future()
        self.expected[transfer_id] = _Expected(
            max_bytes, time.monotonic() + timeout, secret, future
        )
        return future

    def forget(self, transfer_id: str) -> None:
        exp = self.expected.pop(transfer_id, None)
        if exp is not None and not exp.future.done():
            exp.future.cancel()

    def allocate(self, header: TransferHeader) -> memoryview:
        exp = self.expected.get(header.transfer_id)
        if exp is None or time.monotonic() > exp.deadline:
            self.refused += 1
            raise TransferRejected("unexpected transfer", transfer_id=header.transfer_id)
        if not secret_matches(exp.secret, header):
            self.refused += 1
            raise TransferRejected("wrong transfer secret", transfer_id=header.transfer_id)
        if header.nbytes > exp.max_bytes:
            self.refused += 1
            raise TransferRejected("transfer larger than expected", transfer_id=header.transfer_id)
        return uninitialised(header.nbytes)

    async def complete(self, header: TransferHeader, payload: memoryview) -> None:
        exp = self.expected.pop(header.transfer_id, None)
        if exp is None:
            raise TransferRejected("transfer no longer expected", transfer_id=header.transfer_id)
        if not exp.future.done():
            exp.future.set_result(payload)

    def failed(self, header: TransferHeader | None, reason: str) -> None:
        if header is not None and reason.startswith("refused"):
            return  # counted in allocate
        exp = self.expected.pop(header.transfer_id, None) if header is not None else None
        if exp is not None and not exp.future.done():
            exp.future.set_exception(ConnectionError(reason))


class SplitHandler:
    """One listener, two kinds of transfers: those a node asked for (`pending`: kvcache
    replies) and those announced to it otherwise (`other`: a decode node's assignments)."""

    def __init__(self, pending: PendingTransfers, other: ReceiveHandler) -> None:
        self.pending = pending
        self.other = other

    def _for(self, header: TransferHeader | None) -> ReceiveHandler:
        if header is not None and header.transfer_id in self.pending.expected:
            return self.pending
        return self.other

    def allocate(self, header: TransferHeader) -> memoryview:
        return self._for(header).allocate(header)

    async def complete(self, header: TransferHeader, payload: memoryview) -> None:
        await self._for(header).complete(header, payload)

    def failed(self, header: TransferHeader | None, reason: str) -> None:
        self._for(header).failed(header, reason)
