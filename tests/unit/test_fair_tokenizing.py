"""The tokenising thread's turns are shared fairly between API keys
(services/router/tokenizing.py): a key with a backlog delays another key's call by at most
one of its own; a call whose client left is skipped; errors reach their caller."""

from __future__ import annotations

import asyncio
import threading

import pytest

from services.router.tokenizing import FairThread

pytestmark = pytest.mark.unit


async def test_a_backlog_of_one_key_does_not_hold_up_another() -> None:
    thread = FairThread()
    ran: list[str] = []
    gate = threading.Event()

    def call(name: str) -> str:
        gate.wait(5)  # the first holds the thread until every call is queued
        ran.append(name)
        return name

    flood = [asyncio.create_task(thread.run("a", call, f"a{i}")) for i in range(5)]
    await asyncio.sleep(0.05)  # a0 is on the thread, a1..a4 wait
    other = asyncio.create_task(thread.run("b", call, "b0"))
    more = asyncio.create_task(thread.run("c", call, "c0"))
    await asyncio.sleep(0.05)
    assert thread.waiting("a") == 4 and thread.waiting("b") == 1
    gate.set()
    assert await other == "b0" and await more == "c0"
    await asyncio.gather(*flood)
    assert ran == ["a0", "a1", "b0", "c0", "a2", "a3", "a4"]  # the keys in turn


async def test_a_call_whose_client_left_is_skipped_and_errors_reach_their_caller() -> None:
    thread = FairThread()
    gate = threading.Event()
    ran: list[str] = []

    def call(name: str) -> str:
        gate.wait(5)
        ran.append(name)
        if name == "bad":
            raise ValueError("not a prompt")
        return name

    first = asyncio.create_task(thread.run("a", call, "first"))
    await asyncio.sleep(0.05)
    left = asyncio.create_task(thread.run("a", call, "left"))
    bad = asyncio.create_task(thread.run("b", call, "bad"))
    await asyncio.sleep(0.05)
    left.cancel()
    gate.set()
    assert await first == "first"
    with pytest.raises(ValueError, match="not a prompt"):
        await bad
    await asyncio.sleep(0.05)
    assert ran == ["first", "bad"] and thread.calls == 2
