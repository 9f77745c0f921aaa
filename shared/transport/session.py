"""The transfer protocol itself, once for every transport.

A transport only provides a `Channel`: exact-size receives into a given buffer and sends of
whole byte strings (each send is one message on UCX, a `sendall` on TCP; sending a frame's
prefix and body separately works for both, since a message-based receiver must know each
size before it posts the receive).
"""

from __future__ import annotations

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


class Channel(Protocol):
    async def recv_into(self, buf: memoryview) -> None: ...

    async def send(self, data: bytes | memoryview) -> None: ...


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


async def receive_transfer(
    channel: Channel, prefix: memoryview, handler: ReceiveHandler
) -> TransferHeader:
    """One transfer after its prefix arrived. Refusals and bad checksums are answered and
    reported to the handler; the stream stays in step. Raises WireFormatError (or the
    channel's errors) when the connection must be dropped."""
    raw = memoryview(bytearray(parse_prefix(prefix)))
    await channel.recv_into(raw)
    header = decode_header(raw)
    try:
        buf = handler.allocate(header)
    except TransferRejected as exc:
        handler.failed(header, f"refused: {exc.message}")
        await _answer(channel, header.transfer_id, False, exc.message)
        return header
    if len(buf) != header.nbytes:
        raise WireFormatError("handler buffer size mismatch")
    await _answer(channel, header.transfer_id, True)
    await channel.recv_into(buf)
    bad = verify(header, buf)
    if bad is not None:
        reason = f"checksum: chunk {bad} corrupt"
        handler.failed(header, reason)
        await _answer(channel, header.transfer_id, False, reason)
        return header
    try:
        await handler.complete(header, buf)
    except TransferRejected as exc:
        handler.failed(header, f"refused: {exc.message}")
        await _answer(channel, header.transfer_id, False, exc.message)
        return header
    await _answer(channel, header.transfer_id, True)
    return header


async def send_transfer(
    channel: Channel, header: TransferHeader, payload: memoryview, peer: str
) -> tuple[bool, str]:
    """Run one transfer as the sender. Returns (ok, reason); the channel stays usable after
    any return (also a refusal); it is in doubt only when this raises."""
    await _send_framed(channel, encode_header(header), PREFIX.size)
    ready = await read_ack(channel)
    if not ready.ok:
        return False, f"{peer} refused: {ready.reason}"
    await channel.send(payload.cast("B") if payload.format != "B" else payload)
    done = await read_ack(channel)
    if not done.ok:
        return False, f"{peer} rejected: {done.reason}"
    return True, ""
