"""The framing of one KV transfer: a typed header, then raw bytes checked per block.

On the wire: `b"TKX1"`, header length (u32 LE), msgpack `TransferHeader`, then `nbytes` of
payload; the receiver answers with an `Ack`. The payload is cut into `chunk_bytes` chunks
(one KV block each for KV transfers) and every chunk carries an xxh3-64 checksum in the
header, so a receiver verifies what it got and rejects a bad transfer whole.

Admission: a receiver takes a transfer only if it was announced over the (authenticated)
control plane, with a per-transfer `secret` that only the announcing parties know. The
header carries `mac`, an HMAC-SHA256 keyed by that secret over the rest of the header (ids,
sizes, shape and every chunk's checksum), never the secret itself: knowing a transfer id (a
request id is not secret) is not enough to push bytes into a node, and what an observer of
the data network sees of one transfer's header admits no other transfer. The payload is
covered through its chunks' checksums; xxh3 is not a MAC, so an attacker who can rewrite
traffic on the path could still substitute a chunk of equal xxh3-64 (docs/security.md).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from typing import Annotated

import msgspec
import xxhash

from shared.errors import WireFormatError

MAGIC = b"TKX1"
VERSION = 3  # 2: no ready answer to the header; 3: a MAC of the header, not the secret
PREFIX = struct.Struct("<4sI")
MAX_HEADER_BYTES = 256 * 1024
MAX_TRANSFER_BYTES = 4 << 30
MAX_CHUNK_BYTES = 64 << 20  # a payload part is at least one chunk: it bounds every part
ACK_PREFIX = struct.Struct("<4sI")
ACK_MAGIC = b"TKA1"

DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2, "uint8": 1, "int32": 4, "int64": 8}


MAX_DIMS = 8  # a KV block run is [blocks, layers, 2, heads, block, dim]: 6
# Bounds the decoder enforces field by field, before anything else looks at a header: what
# a stranger's header can cost is then linear in its (bounded) size. Unbounded, 29,100 shape
# entries of 2**63 - 1 took seconds of the event loop to multiply out (issue 49).
_Id = Annotated[str, msgspec.Meta(max_length=256)]
_Dim = Annotated[int, msgspec.Meta(ge=1, le=MAX_TRANSFER_BYTES)]
_Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_TRANSFER_BYTES)]


class TransferHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    v: int
    request_id: _Id
    transfer_id: _Id
    dtype: Annotated[str, msgspec.Meta(max_length=16)]
    shape: Annotated[list[_Dim], msgspec.Meta(min_length=1, max_length=MAX_DIMS)]
    nbytes: _Count
    chunk_bytes: _Count
    checksums: list[int]  # xxh3-64 (msgpack carries no integer past 64 bits)
    first_block: _Count = 0
    num_blocks: _Count = 0
    layer_start: _Count = 0
    layer_end: _Count = 0
    traceparent: Annotated[str, msgspec.Meta(max_length=128)] = ""
    # HMAC-SHA256 of the rest, keyed by the announcement's secret (hex)
    mac: Annotated[str, msgspec.Meta(max_length=64)] = ""


def new_secret() -> str:
    return secrets.token_urlsafe(16)


def header_mac(secret: str, header: TransferHeader) -> str:
    """The MAC of `header` (its `mac` field left out) under `secret`."""
    body = msgspec.msgpack.encode(msgspec.structs.replace(header, mac=""))
    return hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def secret_matches(expected: str, header: TransferHeader) -> bool:
    """Whether `header` was made by a holder of `expected`. Constant-time: the time a
    refusal takes says nothing about the MAC."""
    if not expected:
        return False
    return hmac.compare_digest(header_mac(expected, header).encode(), header.mac.encode())


class Ack(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    transfer_id: str
    ok: bool
    reason: str = ""


def checksums(payload: memoryview, chunk_bytes: int) -> list[int]:
    return [
        xxhash.xxh3_64_intdigest(payload[i : i + chunk_bytes])
        for i in range(0, len(payload), chunk_bytes)
    ]


def make_header(
    request_id: str,
    transfer_id: str,
    payload: memoryview,
    *,
    dtype: str = "uint8",
    shape: list[int] | None = None,
    chunk_bytes: int = 1 << 20,
    known_checksums: list[int] | None = None,
    secret: str = "",
    **fields: int | str,
) -> TransferHeader:
    """A header for `payload` with its per-chunk checksums (computed, unless the caller
    already holds them: `known_checksums`, xxh3-64 of each chunk), and its MAC under the
    transfer's `secret` when one is given."""
    view = payload.cast("B") if payload.format != "B" or payload.ndim != 1 else payload
    header = TransferHeader(
        v=VERSION,
        request_id=request_id,
        transfer_id=transfer_id,
        dtype=dtype,
        shape=shape if shape is not None else [len(view) // DTYPE_SIZES[dtype]],
        nbytes=len(view),
        chunk_bytes=chunk_bytes,
        checksums=known_checksums if known_checksums is not None else checksums(view, chunk_bytes),
        **fields,  # type: ignore[arg-type]
    )
    return msgspec.structs.replace(header, mac=header_mac(secret, header)) if secret else header


def encode_header(header: TransferHeader) -> bytes:
    body = msgspec.msgpack.encode(header)
    return PREFIX.pack(MAGIC, len(body)) + body


_decoder = msgspec.msgpack.Decoder(TransferHeader)
_ack_decoder = msgspec.msgpack.Decoder(Ack)


def parse_prefix(data: bytes | memoryview) -> int:
    """Header length from the fixed prefix, or WireFormatError."""
    if len(data) != PREFIX.size:
        raise WireFormatError("truncated transfer prefix")
    magic, length = PREFIX.unpack(data)
    if magic != MAGIC:
        raise WireFormatError(f"not a transfer frame (magic {bytes(magic)!r})")
    if not 0 < length <= MAX_HEADER_BYTES:
        raise WireFormatError(f"transfer header length {length} out of range")
    return int(length)


def decode_header(data: bytes | memoryview, max_bytes: int = MAX_TRANSFER_BYTES) -> TransferHeader:
    """Validate a header: types, version, and that shape, size and checksums agree."""
    try:
        header = _decoder.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise WireFormatError(f"bad transfer header: {exc}") from exc
    if header.v != VERSION:
        raise WireFormatError(f"unsupported transfer version {header.v}")
    size = DTYPE_SIZES.get(header.dtype)
    if size is None:
        raise WireFormatError(f"unknown dtype {header.dtype!r}")
    if not 0 < header.nbytes <= max_bytes:
        raise WireFormatError(f"transfer of {header.nbytes} bytes out of range")
    numel = 1
    for d in header.shape:  # at most MAX_DIMS factors, each bounded, stopping past the size
        numel *= d
        if numel * size > header.nbytes:
            break
    if numel * size != header.nbytes:
        raise WireFormatError("transfer shape, dtype and byte count disagree")
    if not 0 < header.chunk_bytes <= MAX_CHUNK_BYTES:
        raise WireFormatError(f"chunk size {header.chunk_bytes} out of range")
    if len(header.checksums) != -(-header.nbytes // header.chunk_bytes):
        raise WireFormatError("checksum count does not match the chunks")
    return header


def verify(
    header: TransferHeader, payload: memoryview, first_chunk: int = 0, whole: bool = True
) -> int | None:
    """Index of the first chunk whose checksum fails (or that is missing), or None when all
    match. With `whole=False`, `payload` is a part: whole chunks from `first_chunk` on."""
    want = header.checksums
    got = checksums(payload, header.chunk_bytes)
    for i, value in enumerate(got, start=first_chunk):
        if i >= len(want) or value != want[i]:
            return i
    if whole and first_chunk + len(got) < len(want):
        return first_chunk + len(got)  # a short payload: its first missing chunk
    return None


def encode_ack(ack: Ack) -> bytes:
    body = msgspec.msgpack.encode(ack)
    return ACK_PREFIX.pack(ACK_MAGIC, len(body)) + body


def parse_ack_prefix(data: bytes | memoryview) -> int:
    if len(data) != ACK_PREFIX.size:
        raise WireFormatError("truncated transfer acknowledgement")
    magic, length = ACK_PREFIX.unpack(data)
    if magic != ACK_MAGIC or not 0 < length <= 64 * 1024:
        raise WireFormatError("bad transfer acknowledgement")
    return int(length)


def decode_ack(data: bytes | memoryview) -> Ack:
    try:
        return _ack_decoder.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise WireFormatError(f"bad transfer acknowledgement: {exc}") from exc
