"""The kvcache node's store of requests' partial last blocks: one per request, bounded bytes,
dropped a lease after the last write."""

from __future__ import annotations

import pytest

from services.kvcache.tails import TailStore
from shared.bus.messages import KVTail

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def tail(rid: str, n: int = 3) -> KVTail:
    return KVTail(rid, 16, b"\x01" * 16, list(range(n)))


def test_one_tail_per_request_replaced_by_the_latest() -> None:
    store = TailStore(1000)
    store.put(tail("a", 2), b"x" * 100)
    store.put(tail("a", 3), b"y" * 100)
    assert len(store) == 1 and store.used_bytes == 100
    got = store.get("a")
    assert got == (tail("a", 3), b"y" * 100)
    assert store.get("b") is None


def test_bytes_are_bounded_least_recently_written_first() -> None:
    store = TailStore(250)
    for rid in "abc":
        store.put(tail(rid), b"z" * 100)
    assert store.get("a") is None  # pushed out by c
    assert store.used_bytes == 200 and store.dropped == 1
    store.put(tail("b"), b"w" * 100)  # b rewritten: now c is the oldest
    store.put(tail("d"), b"v" * 100)
    assert store.get("c") is None and store.get("b") is not None
    assert not store.put(tail("e"), b"u" * 300)  # larger than the whole store
    assert store.get("e") is None and store.used_bytes == 200


def test_a_tail_goes_a_lease_after_its_last_write() -> None:
    clock = Clock()
    store = TailStore(1000, ttl=5.0, clock=clock)
    store.put(tail("a"), b"x" * 10)
    clock.now += 3
    store.put(tail("b"), b"x" * 10)
    clock.now += 2.5  # a: 5.5 s old, b: 2.5 s
    assert store.expire() == 1
    assert store.get("a") is None and store.get("b") is not None
    store.put(tail("b"), b"y" * 10)  # a write renews the lease
    clock.now += 4.9
    assert store.get("b") is not None
    clock.now += 0.2
    assert store.get("b") is None and store.used_bytes == 0
