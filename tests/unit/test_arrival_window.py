"""An idle decode node waits for a wave of prompts to arrive whole (services/decode/gather.py):
it holds its first step while prompts keep coming, never past the limit, never while
streams run, and once its window is spent it steps without waiting again."""

from __future__ import annotations

from services.decode.gather import ArrivalWindow


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def window(clock: Clock) -> ArrivalWindow:
    return ArrivalWindow(quiet=0.01, limit=0.05, clock=clock)


def test_a_lone_prompt_waits_the_quiet_time_once() -> None:
    clock = Clock()
    w = window(clock)
    assert w.wait(running=0, waiting=1) == 0.01
    clock.now += 0.01
    assert w.wait(running=0, waiting=1) == 0.0
    clock.now += 0.001
    assert w.wait(running=0, waiting=1) == 0.0  # spent: it does not wait again


def test_each_arrival_extends_the_window_up_to_the_limit() -> None:
    clock = Clock()
    w = window(clock)
    start = clock.now
    for waiting in range(1, 20):  # a prompt every 8 ms (or when the wait ends), too long
        wait = w.wait(running=0, waiting=waiting)
        if wait == 0.0:
            break
        assert wait <= 0.01 + 1e-9
        clock.now += min(wait, 0.008)
    assert abs(clock.now - start - 0.05) < 1e-9  # the limit, not the trickle, ended it


def test_running_streams_never_wait_and_reset_the_window() -> None:
    clock = Clock()
    w = window(clock)
    assert w.wait(running=0, waiting=2) > 0
    clock.now += 0.02
    assert w.wait(running=0, waiting=2) == 0.0  # spent
    assert w.wait(running=3, waiting=2) == 0.0  # streams run: step now, window reset
    assert w.wait(running=0, waiting=0) == 0.0  # nothing waits: nothing to gather
    assert w.wait(running=0, waiting=1) == 0.01  # idle again: a new window


def test_a_zero_quiet_time_turns_it_off() -> None:
    assert ArrivalWindow(quiet=0.0, limit=0.05).wait(running=0, waiting=5) == 0.0
