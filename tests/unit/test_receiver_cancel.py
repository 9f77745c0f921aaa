"""A cancel names an attempt; the decode node's table of announced transfers is keyed by
transfer id, which after a failover is not the attempt id. The cancel must still drop
every transfer announced for that attempt, and only those."""

from __future__ import annotations

import time

import pytest

from shared.bus.ids import AttemptId, handoff_transfer_id
from shared.bus.messages import SequenceSnapshot
from shared.connector.receiver import Expected, KVReceiver
from shared.sampling_params import SamplingParams

pytestmark = pytest.mark.unit


def announced(attempt: str) -> Expected:
    snap = SequenceSnapshot(AttemptId(attempt), [1, 2], [3], SamplingParams(seed=5), 2)
    return Expected(snap, "tandem.tokens.x", time.time() + 30, 1, "secret")


def test_a_cancel_drops_the_transfers_of_its_attempt_whatever_their_handoff() -> None:
    receiver = KVReceiver.__new__(KVReceiver)  # only its table is exercised here
    receiver.expected = {}
    a, b = AttemptId("cmpl-a"), AttemptId("cmpl-b")
    receiver.expected[handoff_transfer_id(a, 1)] = announced(a)  # a failover's handoff
    receiver.expected[handoff_transfer_id(b, 0)] = announced(b)
    assert handoff_transfer_id(a, 1) != a
    assert receiver.drop(a)
    assert list(receiver.expected) == [b]
    assert not receiver.drop(a)  # nothing left of it
