"""The transfer protocol itself, once for every transport.

A transport only provides a `Channel`: exact-size receives into a given buffer and sends of
whole byte strings (each send is one message on UCX, a `sendall` on TCP; sending a frame's
prefix and body separately works for both, since a message-based receiver must know each
size before it posts the receive), and the same for a list of parts.

One transfer: the sender sends the header and, without waiting for an answer, the payload
in parts of about SEGMENT_BYTES (whole checksum chunks); the receiver answers once, at the
end. The receiver checks each part's chunks as soon as the part has arrived, while the
next parts are still on their way (UCX posts up to 8 parts ahead), so the checksums
cost little beyond the transfer itself. A receiver that refuses a transfer at its header
(not announced, wrong secret, larger than announced) closes the connection at once: it
neither allocates for the payload nor reads it, so a sender that knows no secret costs a
node a header's read and nothing more (the sender sees the connection lost). A transfer
refused after its payload arrived (a bad checksum, the handler's `complete`) is answered,
and the connection stays in step. Until protocol
version 2 the sender waited for a "ready" answer to the header first; that round trip cost
~1.3 ms of the ~10 ms a 16 MiB transfer takes over UCX here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from shared.errors import WireFormatError
from shared.transport.base import ReceiveHandler, TransferRejected
from shared.transport.frames import (
    ACK_PREFIX,
    PREFIX,
    Ack,
    TransferHeader,
    decode_ack,
    decode_header,
    encode_ack,
    encode_header,
    parse_ack_prefix,
    parse_prefix,
    verify,
)

SEGMENT_BYTES = 4 << 20  # a payload part: small enough to check while the next arrives


class _Refused(Exception):
    """A transfer refused at its header (already reported): drop the connection unread."""


class Channel(Protocol):
    async def recv_into(self, buf: memoryview) -> None: ...

    async def send(self, data: bytes | memoryview) -> None: ...

    async def recv_parts(self, parts: list[memoryview], arrived: Callable[[int], None]) -> None:
        """Receive into every part in order; `arrived(i)` once part i is complete."""
        ...

    async def send_parts(self, parts: list[memoryview]) -> None: ...


def part_bytes(chunk_bytes: int) -> int:
    """The size of a payload part: whole chunks, about SEGMENT_BYTES (one chunk at least)."""
    return max(1, SEGMENT_BYTES // chunk_bytes) * chunk_bytes


def parts(buf: memoryview, chunk_bytes: int) -> list[memoryview]:
    step = part_bytes(chunk_bytes)
    return [buf[i : i + step] for i in range(0, len(buf), step)]


async def _send_framed(channel: Channel, data: bytes, prefix_size: int) -> None:
    await channel.send(data[:prefix_size])
    await channel.send(data[prefix_size:])


async def _answer(channel: Channel, transfer_id: str, ok: bool, reason: str = "") -> None:
    await _send_framed(channel, encode_ack(Ack(transfer_id, ok, reason)), ACK_PREFIX.size)


async def read_ack(channel: Channel) -> Ack:
    prefix = memoryview(bytearray(ACK_PREFIX.size))
    await channel.recv_into(prefix)
    body = memoryview(bytearray(parse_ack_prefix(prefix)))
    await channel.recv_into(body)
    return decode_ack(body)


async def serve_frame(
    channel: Channel,
    prefix: memoryview,
    handler: ReceiveHandler,
    timeout: float,
    lost: tuple[type[BaseException], ...],
    lost_reason: Callable[[BaseException], str],
    header_timeout: float | None = None,
    admitted: Callable[[], None] = lambda: None,
) -> bool:
    """One transfer after its prefix arrived, within `timeout` (its header within
    `header_timeout`, if given: a connection that has not yet proved it knows a secret).
    `admitted()` once the handler took the header. False when the connection must be
    dropped; every failure is reported to the handler (`lost`: the transport's errors for a
    peer gone mid-transfer, described by `lost_reason`), with the transfer's header once
    the handler has taken it: whoever waits for it learns at once."""
    accepted: list[TransferHeader] = []
    try:
        async with asyncio.timeout(timeout):
            await _receive_transfer(channel, prefix, handler, accepted, header_timeout, admitted)
            return True
    except _Refused:
        pass  # refused and reported; the payload is not read
    except WireFormatError as exc:
        handler.failed(_last(accepted), f"malformed: {exc.message}")
    except TimeoutError:
        handler.failed(_last(accepted), "timeout: frame not received within deadline")
    except lost as exc:
        handler.failed(_last(accepted), lost_reason(exc))
    return False


def _last(accepted: list[TransferHeader]) -> TransferHeader | None:
    return accepted[-1] if accepted else None


async def _receive_transfer(
    channel: Channel,
    prefix: memoryview,
    handler: ReceiveHandler,
    accepted: list[TransferHeader],
    header_timeout: float | None,
    admitted: Callable[[], None],
) -> None:
    """One transfer after its prefix arrived. A refusal at the header is reported and raises
    _Refused (nothing allocated, the payload not read); refusals after the payload and bad
    checksums are answered and reported, and the stream stays in step. Raises
    WireFormatError (or the channel's errors) when the connection must be dropped. While
    the payload is on its way into the handler's buffer, its header is in `accepted`, for
    the caller to report a failure with."""
    raw = memoryview(bytearray(parse_prefix(prefix)))
    async with asyncio.timeout(header_timeout):
        await channel.recv_into(raw)
    header = decode_header(raw)
    try:
        buf = handler.allocate(header)
    except TransferRejected as exc:
        handler.failed(header, f"refused: {exc.message}")
        raise _Refused(header.transfer_id) from exc
    admitted()
    accepted.append(header)
    if len(buf) != header.nbytes:
        raise WireFormatError("handler buffer size mismatch")
    pieces = parts(buf, header.chunk_bytes)
    per_part = len(pieces[0]) // header.chunk_bytes
    bad: list[int] = []

    def arrived(i: int) -> None:
        if not bad:
            got = verify(header, pieces[i], first_chunk=i * per_part, whole=False)
            if got is not None:
                bad.append(got)

    await channel.recv_parts(pieces, arrived)
    accepted.clear()  # the handler learns the outcome below, once
    if bad:
        reason = f"checksum: chunk {bad[0]} corrupt"
        handler.failed(header, reason)
        await _answer(channel, header.transfer_id, False, reason)
        return
    try:
        await handler.complete(header, buf)
    except TransferRejected as exc:
        handler.failed(header, f"refused: {exc.message}")
        await _answer(channel, header.transfer_id, False, exc.message)
        return
    await _answer(channel, header.transfer_id, True)


async def send_transfer(
    channel: Channel, header: TransferHeader, payload: memoryview, peer: str
) -> tuple[bool, str]:
    """Run one transfer as the sender. Returns (ok, reason); the channel stays usable after
    any return (also a refusal); it is in doubt only when this raises."""
    view = payload.cast("B") if payload.format != "B" or payload.ndim != 1 else payload
    if len(view) != header.nbytes:  # the receiver would fall out of step
        raise ValueError(f"payload of {len(view)} bytes, header says {header.nbytes}")
    await _send_framed(channel, encode_header(header), PREFIX.size)
    await channel.send_parts(parts(view, header.chunk_bytes))
    done = await read_ack(channel)
    if not done.ok:
        return False, f"{peer} refused: {done.reason}"
    return True, ""
