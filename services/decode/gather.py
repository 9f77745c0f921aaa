"""An idle node's arrival window: prompts that arrive together start together.

Clients that open many streams at once (`vllm bench serve --max-concurrency 16`, a batch
job's first wave) send their requests within a few milliseconds; the router forwards them one
by one. An idle decode node used to start prefilling the first one or two the moment they
were admitted, and that prefill took both cores, so the router, starved, forwarded the rest
most of a second later (measured: 2 requests routed, then 14 more 0.9 s later). The two
streams then ran a prefill ahead of the other fourteen, finished ahead of them, and every
later wave of the closed loop was split the same way: the next prompts of those two were
chunked into the fourteen's steps, each a stall for every running stream (ITL p99 0.3 s
against 0.13 s steps; docs/benchmarks-log.md, "Under vllm bench serve").

So a node with nothing running and prompts waiting holds its first step until no new
prompt has come for `quiet` seconds, and never longer than `limit` seconds in all. A lone
request pays `quiet` once; a wave is admitted whole, prefilled as one burst
(scheduler.py) and decodes in step. A node with streams running never waits: its streams
come first.
"""

from __future__ import annotations

import time
from collections.abc import Callable

QUIET_SECONDS = 0.01  # arrivals of one wave come ~1 ms apart through the router
LIMIT_SECONDS = 0.05  # at most this long in all: a steady trickle does not hold a node


class ArrivalWindow:
    """Decides, before each step, whether an idle node should wait for more prompts."""

    def __init__(
        self,
        quiet: float = QUIET_SECONDS,
        limit: float = LIMIT_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.quiet = quiet
        self.limit = limit
        self.clock = clock
        self.opened: float | None = None  # when this window opened (None: not open)
        self.last: float = 0.0  # when the waiting count last grew
        self.waiting = 0  # the waiting count seen last
        self.closed = False  # this idle spell's window has been spent

    def wait(self, running: int, waiting: int) -> float:
        """Seconds to wait before the next step (0: step now), given the engine's running
        and waiting sequence counts."""
        if running or not waiting or self.quiet <= 0:
            self.opened, self.closed, self.waiting = None, False, 0
            return 0.0
        if self.closed:
            return 0.0
        now = self.clock()
        if self.opened is None:
            self.opened = self.last = now
        elif waiting > self.waiting:
            self.last = now
        self.waiting = waiting
        left = min(self.quiet - (now - self.last), self.limit - (now - self.opened))
        if left <= 0:
            self.closed = True
            return 0.0
        return left
