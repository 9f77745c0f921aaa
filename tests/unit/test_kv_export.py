"""KV export frames: exact round trip, and clean errors for anything malformed."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.errors import WireFormatError
from shared.kv.export import decode_kv, encode_kv, new_frame
from shared.kv.paged_cache import KVLayout, PagedKVCache

pytestmark = pytest.mark.unit


def layout(dtype: torch.dtype = torch.float32) -> KVLayout:
    return KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_between_caches(dtype: torch.dtype) -> None:
    lay = layout(dtype)
    src = PagedKVCache(lay, 10, torch.device("cpu"))
    src.kv.copy_(torch.randn(src.kv.shape).to(dtype))
    frame = encode_kv(lay, src.read_blocks([7, 2, 5]), num_tokens=10)
    header, data = decode_kv(frame)
    assert header.num_blocks == 3 and header.num_tokens == 10 and header.layout() == lay
    dst = PagedKVCache(lay, 6, torch.device("cpu"))
    dst.write_blocks([0, 1, 2], data)
    assert torch.equal(dst.kv[:, :, 0], src.kv[:, :, 7])
    assert torch.equal(dst.kv[:, :, 1], src.kv[:, :, 2])
    assert torch.equal(dst.kv[:, :, 2], src.kv[:, :, 5])


def test_blocks_are_read_straight_into_an_aligned_frame_and_imported_from_it() -> None:
    lay = layout()
    src = PagedKVCache(lay, 10, torch.device("cpu"))
    src.kv.copy_(torch.randn(src.kv.shape))
    frame, payload = new_frame(lay, 2, num_tokens=7)
    src.read_blocks([3, 8], out=payload)
    assert payload.data_ptr() % 64 == 0  # the copies into and out of it at full speed
    header, data = decode_kv(frame)
    assert header.num_blocks == 2 and header.num_tokens == 7
    assert torch.equal(data[1], src.kv[:, :, 8])
    data[1].zero_()  # a writable frame (as received) is viewed, not copied
    assert not payload[1].any()
    frozen = bytes(frame)  # a read-only one is copied: its tensor may be written
    _, copy = decode_kv(frozen)
    copy.zero_()
    assert decode_kv(frozen)[1][0].abs().sum() > 0
    with pytest.raises(ValueError):
        src.read_blocks([3], out=payload)  # out must fit the blocks exactly


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slots_leave_slot_major_and_go_back_into_any_block(dtype: torch.dtype) -> None:
    lay = layout(dtype)
    src = PagedKVCache(lay, 10, torch.device("cpu"))
    src.kv.copy_(torch.randn(src.kv.shape).to(dtype))
    rows = src.read_slots([(7, 1, 3), (2, 0, 1), (5, 3, 4)])
    assert rows.shape == (4, 3, 2, 2, 8)
    assert torch.equal(rows[0], src.kv[:, :, 7, 1]) and torch.equal(rows[1], src.kv[:, :, 7, 2])
    assert torch.equal(rows[2], src.kv[:, :, 2, 0]) and torch.equal(rows[3], src.kv[:, :, 5, 3])
    raw = rows.view(torch.uint8).reshape(-1).numpy().tobytes()
    assert len(raw) == 4 * lay.bytes_per_slot and lay.bytes_per_slot * 4 == lay.bytes_per_block
    dst = PagedKVCache(lay, 6, torch.device("cpu"))
    slot = lay.bytes_per_slot
    assert dst.write_slots(4, 0, raw[: 2 * slot]) == 2  # the two rows from block 7
    assert dst.write_slots(4, 2, memoryview(raw)[3 * slot :]) == 1
    assert torch.equal(dst.kv[:, :, 4, :2], src.kv[:, :, 7, 1:3])
    assert torch.equal(dst.kv[:, :, 4, 2], src.kv[:, :, 5, 3])
    assert not dst.kv[:, :, 4, 3].any()
    for bad_first, bad in ((0, raw[: slot + 1]), (3, raw[: 2 * slot])):  # not whole rows; past
        with pytest.raises(ValueError):
            dst.write_slots(1, bad_first, bad)
    assert not dst.kv[:, :, 1].any()


def good_frame() -> bytes:
    lay = layout()
    cache = PagedKVCache(lay, 2, torch.device("cpu"))
    return bytes(encode_kv(lay, cache.read_blocks([0, 1]), num_tokens=8))


def test_truncated_frame_is_rejected() -> None:
    frame = good_frame()
    for cut in (0, 3, 8, 20, len(frame) - 1):
        with pytest.raises(WireFormatError):
            decode_kv(frame[:cut])


def test_extra_bytes_and_bad_magic_are_rejected() -> None:
    frame = good_frame()
    with pytest.raises(WireFormatError):
        decode_kv(frame + b"\0")
    with pytest.raises(WireFormatError):
        decode_kv(b"XKV1" + frame[4:])


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_only_raise_wire_errors(data: bytes) -> None:
    with pytest.raises(WireFormatError):
        decode_kv(data)


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0), st.integers(min_value=0, max_value=255))
def test_mutated_header_bytes_never_crash(pos: int, value: int) -> None:
    frame = bytearray(good_frame())
    pos %= 200  # the prefix and header sit at the front
    frame[pos] = value
    try:
        header, data = decode_kv(bytes(frame))
    except WireFormatError:
        return
    assert data.numel() * data.element_size() == header.payload_bytes
