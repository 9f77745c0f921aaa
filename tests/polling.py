"""Waiting in tests: poll until a condition holds, then go on; never a fixed sleep.

A fixed sleep before an assert is a guess at how long something takes, and a loaded 2-core
CI machine proves every such guess wrong now and then. These look often and give up only at
a deadline far past any normal wait, with a message naming what never happened.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar, overload

T = TypeVar("T")

DEADLINE = 30.0  # seconds: far past a normal wait, even on a loaded 2-core CI machine
INTERVAL = 0.05  # seconds between looks


def _timed_out(what: str, timeout: float, last: object) -> AssertionError:
    seen = "" if isinstance(last, bool) else f" (last seen: {last!r})"
    return AssertionError(f"timed out after {timeout:g} s waiting for {what}{seen}")


@overload
async def wait_until(
    what: str,
    check: Callable[[], Awaitable[T | None]],
    timeout: float = ...,
    interval: float = ...,
) -> T: ...
@overload
async def wait_until(
    what: str, check: Callable[[], T | None], timeout: float = ..., interval: float = ...
) -> T: ...
async def wait_until(
    what: str,
    check: Callable[[], object],
    timeout: float = DEADLINE,
    interval: float = INTERVAL,
) -> object:
    """Until `check()` (awaited if it returns an awaitable) is truthy; returns that value
    (a check may return None for "not yet"). Past `timeout` seconds an AssertionError naming
    `what`, the awaited condition."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        value = await got if inspect.isawaitable(got) else got
        if value:
            return value
        if time.monotonic() > deadline:
            raise _timed_out(what, timeout, value)
        await asyncio.sleep(interval)


def wait_until_sync(
    what: str, check: Callable[[], T | None], timeout: float = DEADLINE, interval: float = INTERVAL
) -> T:
    """`wait_until` for a test without an event loop: blocks between looks."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise _timed_out(what, timeout, value)
        time.sleep(interval)
