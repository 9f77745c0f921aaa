"""KV export format: a typed header plus raw block bytes, so a sequence's KV can leave the process.

Frame: `b"TKV1"`, header length (u32 little-endian), msgpack header, raw payload. The payload
is block-major `[num_blocks, layers, 2, block_size, kv_heads, head_dim]` in the header's
dtype (each block contiguous), so import is one copy into freshly allocated blocks. No
pickle: the header is a msgspec Struct decoded with validation, the payload plain bytes.
"""

from __future__ import annotations

import struct

import msgspec
import torch

from shared.errors import WireFormatError
from shared.kv.paged_cache import KVLayout

MAGIC = b"TKV1"
EXPORT_VERSION = 1
_PREFIX = struct.Struct("<4sI")
MAX_HEADER_BYTES = 1 << 20

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


def encode_kv(
    layout: KVLayout, blocks: torch.Tensor, num_tokens: int, first_block: int = 0
) -> bytes:
    """Frame `blocks` (as returned by `PagedKVCache.read_blocks`) with its header."""
    raw = blocks.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    header = KVExportHeader(
        version=EXPORT_VERSION,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        block_size=layout.block_size,
        dtype=DTYPE_NAMES[layout.dtype],
        num_tokens=num_tokens,
        first_block=first_block,
        num_blocks=int(blocks.shape[0]),
        payload_bytes=len(raw),
    )
    head = msgspec.msgpack.encode(header)
    return _PREFIX.pack(MAGIC, len(head)) + head + raw


_header_decoder = msgspec.msgpack.Decoder(KVExportHeader)


def decode_kv(frame: bytes | bytearray | memoryview) -> tuple[KVExportHeader, torch.Tensor]:
    """Validate a frame and return its header and a tensor (a copy) of its blocks."""
    header, payload = split_frame(frame)
    return header, header.layout().blocks_from_bytes(bytearray(payload), header.num_blocks)


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
