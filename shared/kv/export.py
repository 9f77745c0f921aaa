"""KV export format: a typed header plus raw block bytes, so a sequence's KV can leave the process.

Frame: `b"TKV1"`, header length (u32 little-endian), msgpack header, raw payload. The payload
is block-major `[num_blocks, layers, 2, block_size, kv_heads, head_dim]` in the header's
dtype (each block contiguous), so import is one copy into freshly allocated blocks. No
pickle: the header is a msgspec Struct decoded with validation, the payload plain bytes.
"""

from __future__ import annotations

import struct

import msgspec
import numpy as np
import torch

from shared.buffers import uninitialised
from shared.errors import WireFormatError
from shared.kv.paged_cache import KVLayout

MAGIC = b"TKV1"
EXPORT_VERSION = 1
_PREFIX = struct.Struct("<4sI")
MAX_HEADER_BYTES = 1 << 20
_ALIGN = 64  # bytes: where a frame we build puts its payload

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
}
DTYPES_BY_NAME = {name: dtype for dtype, name in DTYPE_NAMES.items()}


class KVExportHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the payload holds: which blocks of a sequence, in which layout."""

    version: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    num_tokens: int  # KV tokens of the sequence covered by the blocks up to and incl. this range
    first_block: int  # index of the first exported block in the sequence's block table
    num_blocks: int
    payload_bytes: int

    def layout(self) -> KVLayout:
        return KVLayout(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=self.block_size,
            dtype=DTYPES_BY_NAME[self.dtype],
        )


def new_frame(
    layout: KVLayout, num_blocks: int, num_tokens: int, first_block: int = 0
) -> tuple[memoryview, torch.Tensor]:
    """A frame for `num_blocks` blocks with its header written, and a block-major tensor
    over its payload that the caller fills whole (the payload is left uninitialised).

    Filling the payload in place is the export's one copy: a gather into a tensor, its
    bytes, then the header joined on, made three (and faulted in fresh pages each time):
    35 ms for a 610-token prompt's 29 MB on the engine thread, measured."""
    payload_bytes = num_blocks * layout.bytes_per_block
    header = KVExportHeader(
        version=EXPORT_VERSION,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        block_size=layout.block_size,
        dtype=DTYPE_NAMES[layout.dtype],
        num_tokens=num_tokens,
        first_block=first_block,
        num_blocks=num_blocks,
        payload_bytes=payload_bytes,
    )
    head = msgspec.msgpack.encode(header)
    start = _PREFIX.size + len(head)
    raw = uninitialised(start + payload_bytes + _ALIGN)
    # the payload at an aligned address: the copies into and out of it go at full speed
    skip = -(np.frombuffer(raw, dtype=np.uint8).ctypes.data + start) % _ALIGN
    frame = raw[skip : skip + start + payload_bytes]
    _PREFIX.pack_into(frame, 0, MAGIC, len(head))
    frame[_PREFIX.size : start] = head
    shape = layout.blocks_shape(num_blocks)
    if not payload_bytes:
        return frame, torch.empty(shape, dtype=layout.dtype)
    payload = torch.frombuffer(frame[start:], dtype=torch.uint8)
    return frame, payload.view(layout.dtype).view(shape)


def encode_kv(
    layout: KVLayout, blocks: torch.Tensor, num_tokens: int, first_block: int = 0
) -> memoryview:
    """Frame `blocks` (block-major, as `PagedKVCache.read_blocks` returns them)."""
    frame, payload = new_frame(layout, int(blocks.shape[0]), num_tokens, first_block)
    payload.copy_(blocks.detach())
    return frame


_header_decoder = msgspec.msgpack.Decoder(KVExportHeader)


def decode_kv(frame: bytes | bytearray | memoryview) -> tuple[KVExportHeader, torch.Tensor]:
    """Validate a frame and return its header and a tensor of its blocks: a view of a
    writable frame's payload (a received buffer is imported without a copy of its own),
    a copy of a read-only one's."""
    header, payload = split_frame(frame)
    raw = bytearray(payload) if payload.readonly else payload
    return header, header.layout().blocks_from_bytes(raw, header.num_blocks)


def split_frame(frame: bytes | bytearray | memoryview) -> tuple[KVExportHeader, memoryview]:
    """Validate a frame; its header and a view of its payload (block i at i * block bytes)."""
    view = memoryview(frame).cast("B")
    if len(view) < _PREFIX.size:
        raise WireFormatError("KV frame truncated before its header")
    magic, head_len = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise WireFormatError(f"not a KV frame (magic {bytes(magic)!r})")
    if head_len > MAX_HEADER_BYTES or _PREFIX.size + head_len > len(view):
        raise WireFormatError("KV frame header length out of range")
    try:
        header = _header_decoder.decode(view[_PREFIX.size : _PREFIX.size + head_len])
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # bad UTF-8 in a str field
        raise WireFormatError(f"bad KV frame header: {exc}") from exc
    if header.version != EXPORT_VERSION:
        raise WireFormatError(f"unsupported KV frame version {header.version}")
    if header.dtype not in DTYPES_BY_NAME:
        raise WireFormatError(f"unknown KV dtype {header.dtype!r}")
    dims = header.layout().blocks_shape(header.num_blocks)
    if min(dims) <= 0 or header.first_block < 0 or header.num_tokens < 0:
        raise WireFormatError("KV frame header has non-positive dimensions")
    dtype = DTYPES_BY_NAME[header.dtype]
    expected = torch.Size(dims).numel() * torch.empty((), dtype=dtype).element_size()
    payload = view[_PREFIX.size + head_len :]
    if header.payload_bytes != expected or len(payload) != expected:
        raise WireFormatError(
            f"KV payload is {len(payload)} bytes, header says {header.payload_bytes}, "
            f"shape needs {expected}"
        )
    return header, payload
