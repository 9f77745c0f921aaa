"""Issue 49: /tokenize and /detokenize share the one tokenising thread with completions,
so a call waiting for it counts against --max-inflight as a request does: with the router
full it gets a 429 at once instead of queueing without bound ahead of the completions."""

from __future__ import annotations

import threading

import pytest

from services.router.inflight import InFlight
from services.router.tokens_api import TokensApi
from services.router.validation import Limits
from shared.errors import RateLimitError


def api(inflight: InFlight) -> TokensApi:
    return TokensApi({}, Limits(), 1 << 20, 10.0, inflight)


async def test_a_full_router_refuses_tokenising_at_once() -> None:
    inflight = InFlight(max_inflight=2)
    with inflight.admit(2), pytest.raises(RateLimitError):
        await api(inflight)._on_thread({}, lambda: "never run")  # type: ignore[arg-type]


async def test_a_call_counts_in_flight_while_it_waits_for_the_thread() -> None:
    inflight = InFlight(max_inflight=4)
    seen: list[int] = []

    def work() -> str:
        seen.append(inflight.admitted)  # on the tokenising thread
        assert threading.current_thread().name.startswith("tokenize")
        return "done"

    assert await api(inflight)._on_thread({}, work) == "done"  # type: ignore[arg-type]
    assert seen == [1] and inflight.admitted == 0
