"""Transfer frames: header validation, checksums, and fuzzed bytes → only clean errors."""

from __future__ import annotations

import contextlib
import os

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.errors import WireFormatError
from shared.transport import frames as f

pytestmark = pytest.mark.unit

PAYLOAD = memoryview(bytearray(os.urandom(10_000)))


def good() -> f.TransferHeader:
    return f.make_header("r", "t", PAYLOAD, chunk_bytes=4096)


def test_round_trip_and_checksums() -> None:
    header = good()
    raw = f.encode_header(header)
    length = f.parse_prefix(raw[: f.PREFIX.size])
    assert f.decode_header(raw[f.PREFIX.size : f.PREFIX.size + length]) == header
    assert len(header.checksums) == 3
    assert f.verify(header, PAYLOAD) is None
    bad = bytearray(PAYLOAD)
    bad[5000] ^= 1
    assert f.verify(header, memoryview(bad)) == 1
    # a part of the transfer (whole chunks from chunk 1 on), as a receiver checks it
    chunk = header.chunk_bytes
    assert f.verify(header, memoryview(bad)[chunk:], first_chunk=1, whole=False) == 1
    assert f.verify(header, memoryview(bad)[2 * chunk :], first_chunk=2, whole=False) is None
    assert f.verify(header, PAYLOAD[chunk:], first_chunk=2, whole=False) == 2  # wrong chunks
    assert f.verify(header, PAYLOAD[:chunk]) == 1  # a whole payload cut short
    assert f.verify(header, PAYLOAD[:chunk], whole=False) is None  # a part may be


@pytest.mark.parametrize(
    "change",
    [
        {"v": 1},  # the old protocol, whose sender waits for a ready answer
        {"v": 2},  # a header that carried the secret itself
        {"v": 4},
        {"dtype": "complex128"},
        {"nbytes": 0},
        {"nbytes": 10_001},
        {"shape": [0]},
        {"shape": []},
        {"chunk_bytes": 0},
        {"chunk_bytes": f.MAX_CHUNK_BYTES + 1, "checksums": [1]},  # parts bound memory
        {"checksums": [1]},
        {"nbytes": f.MAX_TRANSFER_BYTES + 1, "shape": [f.MAX_TRANSFER_BYTES + 1]},
    ],
)
def test_inconsistent_headers_are_rejected(change: dict[str, object]) -> None:
    fields = {k: getattr(good(), k) for k in good().__struct_fields__}
    with pytest.raises(WireFormatError):
        f.decode_header(msgspec.msgpack.encode({**fields, **change}))


def test_prefix_and_ack_checks() -> None:
    with pytest.raises(WireFormatError):
        f.parse_prefix(b"XXXX\x01\x00\x00\x00")
    with pytest.raises(WireFormatError):
        f.parse_prefix(f.PREFIX.pack(f.MAGIC, f.MAX_HEADER_BYTES + 1))
    with pytest.raises(WireFormatError):
        f.parse_prefix(b"TKX")
    ack = f.encode_ack(f.Ack("t", False, "nope"))
    assert f.decode_ack(ack[f.ACK_PREFIX.size :]) == f.Ack("t", False, "nope")
    with pytest.raises(WireFormatError):
        f.parse_ack_prefix(b"TKX1\x05\x00\x00\x00")


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=400))
def test_random_bytes_only_raise_wire_errors(data: bytes) -> None:
    for decoder in (f.decode_header, f.decode_ack):
        with contextlib.suppress(WireFormatError):
            decoder(data)
    for parse in (f.parse_prefix, f.parse_ack_prefix):
        with contextlib.suppress(WireFormatError):
            parse(data[: f.PREFIX.size])


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_mutated_headers_only_raise_wire_errors(data: st.DataObject) -> None:
    raw = bytearray(msgspec.msgpack.encode(good()))
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    try:
        header = f.decode_header(bytes(raw))
    except WireFormatError:
        return
    assert header.nbytes > 0 and len(header.checksums) * header.chunk_bytes >= header.nbytes


def test_the_header_carries_a_mac_of_itself_not_the_secret() -> None:
    """The secret never travels on the data network; the MAC admits only the header it was
    made for: another transfer id, size or checksum under it is refused."""
    payload = memoryview(bytearray(range(256)) * 64)
    secret = f.new_secret()
    header = f.make_header("r", "kv-1", payload, chunk_bytes=4096, secret=secret)
    assert secret not in f.encode_header(header).decode("latin-1")
    assert f.secret_matches(secret, header)
    assert f.secret_matches(secret, f.decode_header(f.encode_header(header)[f.PREFIX.size :]))
    assert not f.secret_matches(f.new_secret(), header)
    assert not f.secret_matches("", header)
    for change in ({"transfer_id": "kv-2"}, {"request_id": "other"}, {"first_block": 3}):
        assert not f.secret_matches(secret, msgspec.structs.replace(header, **change)), change
    forged = list(header.checksums)
    forged[1] ^= 1
    assert not f.secret_matches(secret, msgspec.structs.replace(header, checksums=forged))
    assert not f.secret_matches(secret, f.make_header("r", "kv-1", payload, chunk_bytes=4096))


def _raw_header(**fields: object) -> bytes:
    doc: dict[str, object] = {"v": f.VERSION, "request_id": "r", "transfer_id": "t",
                              "dtype": "uint8", "shape": [100], "nbytes": 100,
                              "chunk_bytes": 100, "checksums": [1]}  # fmt: skip
    doc.update(fields)
    return msgspec.msgpack.encode(doc)


@pytest.mark.parametrize(
    ("fields", "refusal"),
    [
        # issue 49's probe: 29,100 dims of 2**63 - 1 in a 262 KB header took 3.2 s of the
        # event loop to multiply out before the secret was checked
        ({"shape": [2**63 - 1] * 29_100}, "length <= 8"),
        ({"shape": [2**63 - 1]}, "<= 4294967296"),
        ({"shape": []}, "length >= 1"),
        ({"transfer_id": "t" * 5000}, "length <= 256"),
        ({"traceparent": "x" * 1000}, "length <= 128"),
        ({"nbytes": -1}, ">= 0"),
    ],
)
def test_a_strangers_header_is_refused_by_its_bounds_first(
    fields: dict[str, object], refusal: str
) -> None:
    """Every field of a header has a bound the decoder checks as it reads: what a header
    from anyone costs before its MAC is checked is linear in its bounded size."""
    assert len(_raw_header(**fields)) <= f.MAX_HEADER_BYTES
    with pytest.raises(WireFormatError, match=refusal):
        f.decode_header(_raw_header(**fields))


def test_a_shape_whose_product_overflows_stops_at_the_size() -> None:
    """Eight bounded dims multiply to at most 2**256: the product stops once past the byte
    count, and the header is refused as inconsistent."""
    with pytest.raises(WireFormatError, match="disagree"):
        f.decode_header(_raw_header(shape=[1 << 32] * 8))
