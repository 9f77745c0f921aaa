"""The data-plane listener's connection table: strangers bounded and evicted oldest first,
their own address first; peers never evicted; a full table refuses; limits from the
environment; accept errors back off instead of ending the listener."""

from __future__ import annotations

import pytest

from shared.transport.admission import (
    AcceptBackoff,
    AdmissionLimits,
    Connection,
    ConnectionTable,
)


def table(**limits: int) -> tuple[ConnectionTable, list[str]]:
    return ConnectionTable(AdmissionLimits(**limits)), []  # type: ignore[arg-type]


def admit(t: ConnectionTable, closed: list[str], address: str, name: str) -> Connection | None:
    return t.admit(address, lambda: closed.append(name))


def test_a_flood_from_one_address_evicts_its_own_oldest_strangers_only() -> None:
    t, closed = table(per_address=3, max_strangers=100)
    other = admit(t, closed, "10.0.0.2", "other")
    for i in range(10):
        assert admit(t, closed, "10.0.0.9", f"flood-{i}") is not None
    assert closed == [f"flood-{i}" for i in range(7)]  # oldest first, one per newcomer
    assert other in t.strangers and len(t) == 4
    assert t.evicted == 7


def test_all_strangers_count_against_one_cap_evicting_the_oldest() -> None:
    t, closed = table(per_address=100, max_strangers=3)
    for i in range(5):
        admit(t, closed, f"10.0.0.{i}", f"c{i}")
    assert closed == ["c0", "c1"] and len(t) == 3


def test_peers_are_never_evicted_and_a_table_full_of_them_refuses() -> None:
    t, closed = table(per_address=2, max_strangers=2, max_connections=3)
    peers = [c for i in range(2) if (c := admit(t, closed, "10.0.0.1", f"p{i}"))]
    for p in peers:
        t.prove(p)
    assert t.idle_deadline(peers[0]) is None and t.header_deadline(peers[0]) is None
    stranger = admit(t, closed, "10.0.0.1", "s0")
    assert stranger is not None and t.idle_deadline(stranger) == t.limits.stranger_idle
    # full (3): the next one evicts the stranger, not a peer
    s1 = admit(t, closed, "10.0.0.1", "s1")
    assert s1 is not None and closed == ["s0"]
    t.prove(s1)
    assert admit(t, closed, "10.0.0.1", "s2") is None  # three peers: no room
    assert t.refused == 1 and closed == ["s0"]


def test_a_removed_connection_frees_its_room() -> None:
    t, closed = table(per_address=1, max_strangers=1)
    a = admit(t, closed, "10.0.0.1", "a")
    assert a is not None
    t.remove(a)
    assert admit(t, closed, "10.0.0.1", "b") is not None and closed == []


def test_out_of_descriptors_the_oldest_stranger_goes() -> None:
    t, closed = table()
    peer = admit(t, closed, "10.0.0.1", "peer")
    assert peer is not None
    t.prove(peer)
    admit(t, closed, "10.0.0.2", "s0")
    admit(t, closed, "10.0.0.3", "s1")
    assert t.evict_oldest() and closed == ["s0"]
    assert t.evict_oldest() and not t.evict_oldest()  # the peer stays
    assert closed == ["s0", "s1"] and t.peers == {peer}


def test_limits_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_DATA_STRANGER_IDLE", "2.5")
    monkeypatch.setenv("TANDEM_DATA_PER_ADDRESS", "7")
    limits = AdmissionLimits.from_env()
    assert (limits.stranger_idle, limits.per_address) == (2.5, 7)
    assert limits.max_strangers == AdmissionLimits().max_strangers
    monkeypatch.setenv("TANDEM_DATA_MAX_CONNECTIONS", "lots")
    with pytest.raises(ValueError, match="TANDEM_DATA_MAX_CONNECTIONS"):
        AdmissionLimits.from_env()


async def test_accept_backoff_doubles_to_its_ceiling_and_resets() -> None:
    backoff = AcceptBackoff(first=0.001, longest=0.004)
    waits = []
    for _ in range(4):
        waits.append(backoff.next)
        await backoff.failed()
    assert waits == [0.001, 0.002, 0.004, 0.004] and backoff.errors == 4
    backoff.ok()
    assert backoff.next == 0.001
