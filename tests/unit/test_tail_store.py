"""The kvcache node's store of requests' partial last blocks: one per request, extended by
pieces that continue it, bounded bytes, dropped a lease after the last write."""

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


def tail(rid: str, n: int = 3, first: int = 0) -> KVTail:
    return KVTail(rid, 16, b"\x01" * 16, list(range(n)), first)


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


def test_pieces_extend_the_tail_they_continue_and_break_one_they_do_not() -> None:
    store = TailStore(1000)
    assert store.put(tail("a", 2), b"ab")
    assert store.continues(tail("a", 4, first=2)) and not store.continues(tail("a", 4, first=3))
    assert store.put(tail("a", 4, first=2), b"cd")
    assert store.get("a") == (tail("a", 4), b"abcd") and store.used_bytes == 4
    assert store.put(tail("a", 5, first=4), b"e")
    assert store.get("a") == (tail("a", 5), b"abcde")
    # another block, another token before, a gap: the stored tail can no longer be trusted
    for bad in (
        KVTail("a", 32, b"\x01" * 16, list(range(6)), 5),
        KVTail("a", 16, b"\x01" * 16, [0, 1, 2, 9, 4, 5], 5),
        tail("a", 7, first=6),
    ):
        assert not store.continues(bad)
        assert not store.put(bad, b"f") and store.get("a") is None
        store.put(tail("a", 5), b"abcde")
    assert store.broken == 3 and store.used_bytes == 5
    assert not store.put(tail("b", 2, first=1), b"x")  # nothing to extend
    assert store.get("b") is None and store.broken == 3
    assert store.put(tail("a", 1), b"z")  # whole: replaces
    assert store.get("a") == (tail("a", 1), b"z") and store.used_bytes == 1


def test_a_piece_renews_the_lease_and_counts_against_the_bound() -> None:
    clock = Clock()
    store = TailStore(10, ttl=5.0, clock=clock)
    store.put(tail("a", 4), b"aaaa")
    store.put(tail("b", 4), b"bbbb")
    clock.now += 4
    store.put(tail("a", 6, first=4), b"aa")  # a: 6 bytes, written last
    clock.now += 2  # b: 6 s old, a: 2 s
    assert store.get("b") is None and store.get("a") is not None
    store.put(tail("b", 4), b"bbbb")  # 6 + 4 = 10: fits
    store.put(tail("b", 5, first=4), b"b")  # 11: a, the least recently written, goes
    assert store.get("a") is None and store.get("b") == (tail("b", 5), b"bbbbb")
    assert store.dropped == 1 and store.used_bytes == 5
    assert not store.put(tail("b", 16, first=5), b"x" * 11)  # more than the bound: gone
    assert store.get("b") is None and store.used_bytes == 0
