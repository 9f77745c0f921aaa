"""The prefill node's memory of cancels: kept `keep` seconds, at most `limit`, and each
cancel looks only at the oldest entries (no rescan of the table)."""

from __future__ import annotations

from shared.runtime.cancels import RecentCancels


def test_cancels_are_forgotten_after_keep_seconds_oldest_first() -> None:
    now = [1000.0]
    recent = RecentCancels(keep=10, clock=lambda: now[0])
    recent.add("a")
    now[0] += 5
    recent.add("b")
    assert "a" in recent and "b" in recent
    now[0] += 6  # a is 11 s old, b 6 s
    recent.add("c")
    assert "a" not in recent and "b" in recent and "c" in recent
    now[0] += 1
    recent.add("b")  # heard again: its clock restarts
    now[0] += 10
    recent.add("d")
    assert "b" in recent and "c" not in recent and len(recent) == 2


def test_a_storm_keeps_only_the_newest_limit() -> None:
    recent = RecentCancels(keep=600, limit=1_000)
    for i in range(100_000):
        recent.add(f"cmpl-{i}")
    assert len(recent) == 1_000 and "cmpl-99999" in recent and "cmpl-98999" not in recent
