"""Control messages: round trips, version and kind checks, and fuzzed bytes → clean errors."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.bus import messages as m
from shared.bus.messages import SequenceSnapshot
from shared.bus.topology import is_token_subject, token_subject
from shared.errors import WireFormatError
from shared.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

SAMPLES: list[m.Message] = [
    m.PrefillJob(
        attempt_id="r", prompt_ids=[1, 2], params=SamplingParams(max_tokens=3), model="org/m:1"
    ),
    m.DecodeAssignment(
        transfer_id="t",
        snapshot=SequenceSnapshot("r", [1, 2], [3], SamplingParams(seed=5), 2),
        model="m",
    ),
    m.TokenDelta(attempt_id="r", seq=3, token_ids=[7], text="x", finished=True),
    m.Cancel(attempt_id="r", reason="client gone"),
    m.NodeInfo(node_id="d1", role="decode", free_kv_blocks=9, model="m"),
    m.KVEvent(node_id="k1", op="stored", block_hashes=[b"\x01" * 16]),
    m.CheckpointRecord(attempt_id="r", num_tokens=32, block_hashes=[b"\x02" * 16]),
    m.JournalEntry(request_id="r", state="decoding"),
    m.KVPutTails(transfer_id="t", tails=[m.KVTail("r", 16, b"\x03" * 16, [5, 6], 1)], row_bytes=64),
    m.KVPutTailsReply(missing=["r"]),
    m.KVGetTail(transfer_id="t", attempt_id="r", reply_address="tcp://127.0.0.1:9"),
    m.KVWarm(transfer_id="w", reply_address="tcp://127.0.0.1:9", transfer_secret="s"),
    m.KVTailReply(tail=m.KVTail("r", 0, b"\x00" * 16, [5]), nbytes=64),
    m.Prefetch(attempt_id="r", token_ids=[1, 2, 3]),
]
KINDS = [type(s) for s in SAMPLES]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda s: type(s).__name__)
def test_round_trip(msg: m.Message) -> None:
    assert m.decode(m.encode(msg), type(msg)) == msg


def test_wrong_kind_unknown_field_and_version_are_rejected() -> None:
    data = m.encode(SAMPLES[0])
    with pytest.raises(WireFormatError):
        m.decode(data, m.TokenDelta)
    as_dict = msgspec.msgpack.decode(data)
    with pytest.raises(WireFormatError, match="version"):
        m.decode(msgspec.msgpack.encode({**as_dict, "v": 2}), m.PrefillJob)
    with pytest.raises(WireFormatError):
        m.decode(msgspec.msgpack.encode({**as_dict, "surprise": 1}), m.PrefillJob)
    with pytest.raises(WireFormatError):
        m.decode(msgspec.msgpack.encode({**as_dict, "prompt_ids": "nope"}), m.PrefillJob)


@pytest.mark.parametrize(
    ("msg", "field", "bad"),
    [
        (m.NodeInfo(node_id="d1", role="decode"), "role", "decoder"),
        (m.KVEvent(node_id="k1", op="stored"), "op", "deleted"),
        (m.JournalEntry(request_id="r", state="decoding"), "state", "prefilling"),
    ],
)
def test_states_and_roles_outside_their_set_are_rejected(
    msg: m.Message, field: str, bad: str
) -> None:
    as_dict = msgspec.msgpack.decode(m.encode(msg))
    with pytest.raises(WireFormatError):
        m.decode(msgspec.msgpack.encode({**as_dict, field: bad}), type(msg))


def test_a_node_without_a_role_is_rejected() -> None:
    as_dict = msgspec.msgpack.decode(m.encode(m.NodeInfo(node_id="d1", role="decode")))
    del as_dict["role"]
    with pytest.raises(WireFormatError):
        m.decode(msgspec.msgpack.encode(as_dict), m.NodeInfo)


def test_oversize_is_rejected() -> None:
    with pytest.raises(WireFormatError):
        m.decode(b"\0" * (m.MAX_MESSAGE_BYTES + 1), m.Cancel)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(KINDS), st.binary(max_size=300))
def test_random_bytes_raise_only_wire_errors(kind: type[m.Message], data: bytes) -> None:
    with contextlib.suppress(WireFormatError):
        m.decode(data, kind)


@settings(max_examples=400, deadline=None)
@given(st.integers(0, len(SAMPLES) - 1), st.data())
def test_mutated_messages_raise_only_wire_errors(i: int, data: st.DataObject) -> None:
    raw = bytearray(m.encode(SAMPLES[i]))
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(raw) - 1))
        raw[pos] = data.draw(st.integers(0, 255))
    try:
        out = m.decode(bytes(raw), KINDS[i])
    except WireFormatError:
        return
    assert isinstance(out, KINDS[i])


@pytest.mark.parametrize(
    ("subject", "ok"),
    [
        (token_subject("cmpl-abc123"), True),
        ("tandem.tokens.x.y", True),
        ("", False),
        ("tandem.tokens.", False),
        ("tandem.tokens.*", False),
        ("tandem.tokens.>", False),
        ("tandem.tokens.a..b", False),
        ("tandem.tokens.a b", False),
        ("tandem.cancel", False),  # a job must not make a node publish elsewhere
        ("tandem.tokens." + "x" * 300, False),
    ],
)
def test_only_token_subjects_are_accepted_as_reply_subjects(subject: str, ok: bool) -> None:
    assert is_token_subject(subject) is ok


def test_messages_written_before_models_were_named_read_as_the_one_model() -> None:
    """A job, an assignment or a registry entry without `model` (a node or journal of
    before several models) reads as "" (the cluster's one model), not as an error."""
    for msg in [*SAMPLES[:2], SAMPLES[4]]:
        as_dict = msgspec.msgpack.decode(m.encode(msg))
        assert as_dict.pop("model")
        old = m.decode(msgspec.msgpack.encode(as_dict), type(msg))
        assert old.model == "" and msgspec.structs.replace(old, model=msg.model) == msg
