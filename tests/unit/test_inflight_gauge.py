"""The router's in-flight gauge is admission's own count, not a second one kept beside it
(issue 52): it moves with `InFlight.admit`, choices and /tokenize included."""

from __future__ import annotations

import pytest

from services.router.config import RouterConfig
from services.router.parts import RouterParts

pytestmark = pytest.mark.unit


def gauge(parts: RouterParts) -> float:
    value = parts.metrics.registry.get_sample_value("tandem_requests_in_flight")
    assert value is not None
    return value


def test_the_gauge_is_the_admitted_count() -> None:
    parts = RouterParts.of(RouterConfig(), bus=None, nodes=None, journal=None)  # type: ignore[arg-type]
    assert gauge(parts) == 0
    with parts.inflight.admit(3):  # a request of three choices
        assert gauge(parts) == 3
        with parts.inflight.admit():
            assert gauge(parts) == 4 == parts.inflight.admitted
    assert gauge(parts) == 0
