"""The data-plane interface: what a transport does, independent of UCX or TCP.

Sender: `await transport.send(peer, header, payload, timeout)` returns once the receiver
verified the bytes and its handler accepted them; otherwise it raises `TransferError`
(rejected, peer dead, deadline passed, cancelled). Receiver: the transport asks its
`ReceiveHandler` for a buffer sized for the announced transfer (`allocate`, which may
refuse), receives the payload straight into it, verifies checksums, then calls `complete`.
One transfer at a time per connection, so concurrent transfers never interleave bytes;
a transport keeps a small pool of connections per peer for concurrency.
"""

from __future__ import annotations

from collections import Counter
from typing import Protocol

from shared.buffers import uninitialised
from shared.errors import TandemError
from shared.transport.frames import TransferHeader


class TransferError(TandemError):
    """A transfer failed; carries the request and transfer ids."""

    http_status = 503
    error_type = "transfer_error"

    def __init__(self, message: str, *, request_id: str | None = None, transfer_id: str = ""):
        super().__init__(message, request_id=request_id)
        self.transfer_id = transfer_id


class TransferRejected(TransferError):
    """The receiver refused the transfer (unannounced, too big, bad checksum, no room)."""


class ReceiveHandler(Protocol):
    def allocate(self, header: TransferHeader) -> memoryview:
        """A writable buffer of exactly `header.nbytes`; raise TransferRejected to refuse."""
        ...

    async def complete(self, header: TransferHeader, payload: memoryview) -> None:
        """The payload arrived and verified; raise TransferRejected to refuse it now."""
        ...

    def failed(self, header: TransferHeader | None, reason: str) -> None:
        """A transfer into this node failed (counted and logged by the handler)."""
        ...


class Transport(Protocol):
    name: str

    @property
    def address(self) -> str:
        """Where peers reach this node's listener (valid after `start`)."""
        ...

    async def start(self, handler: ReceiveHandler) -> None: ...

    async def send(
        self, peer: str, header: TransferHeader, payload: memoryview, timeout: float
    ) -> None: ...

    async def close(self) -> None: ...


class BufferHandler:
    """A simple ReceiveHandler: fresh bytearrays, completed transfers kept by transfer id.

    Used by tests and benchmarks; services supply handlers that receive into their pools.
    """

    def __init__(self, max_bytes: int = 1 << 31) -> None:
        self.max_bytes = max_bytes
        self.received: dict[str, tuple[TransferHeader, memoryview]] = {}
        self.failures: Counter[str] = Counter()

    def allocate(self, header: TransferHeader) -> memoryview:
        if header.nbytes > self.max_bytes:
            raise TransferRejected(f"{header.nbytes} bytes exceed {self.max_bytes}")
        return uninitialised(header.nbytes)

    async def complete(self, header: TransferHeader, payload: memoryview) -> None:
        self.received[header.transfer_id] = (header, payload)

    def failed(self, header: TransferHeader | None, reason: str) -> None:
        self.failures[reason.split(":")[0]] += 1


class ReusedBuffers(BufferHandler):
    """Receives into one reused buffer per size (as a service receives into its pool) and
    keeps nothing: for measuring the data plane, not for checking what arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.buffers: dict[int, memoryview] = {}

    def allocate(self, header: TransferHeader) -> memoryview:
        if header.nbytes > self.max_bytes:
            return super().allocate(header)  # refused there, with its reason
        if header.nbytes not in self.buffers:
            self.buffers[header.nbytes] = memoryview(bytearray(header.nbytes))
        return self.buffers[header.nbytes]

    async def complete(self, header: TransferHeader, payload: memoryview) -> None:
        return None
