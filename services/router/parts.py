"""The router's parts: what serving a request uses, passed as one bundle of narrow pieces.

Each part owns its own state (the node table, the journal, the in-flight table, the
metrics); a request's own state lives in its `ServedRequest`. Nothing here is the HTTP
application (services/router/app.py), so the request modules need not know it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from services.router.config import RouterConfig
from services.router.dispatch import Dispatch
from services.router.inflight import InFlight
from services.router.metrics import RouterMetrics
from services.router.nodes import NodeTable
from shared.bus.client import Bus
from shared.bus.journal import RequestJournal
from shared.model.tokenizer import TokenizerInfo


@dataclass(frozen=True)
class RouterParts:
    config: RouterConfig
    bus: Bus
    nodes: NodeTable
    journal: RequestJournal
    metrics: RouterMetrics
    dispatch: Dispatch
    inflight: InFlight
    # by served model: token texts (logprobs, echo); a model without one: ids as text
    tokenizers: Mapping[str, TokenizerInfo] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        config: RouterConfig,
        bus: Bus,
        nodes: NodeTable,
        journal: RequestJournal,
        tokenizers: Mapping[str, TokenizerInfo] | None = None,
    ) -> RouterParts:
        inflight = InFlight(config.max_inflight)
        metrics = RouterMetrics()
        # the gauge reads admission's own count: one number, kept in one place
        metrics.inflight.set_function(lambda: inflight.admitted)
        return cls(
            config=config,
            bus=bus,
            nodes=nodes,
            journal=journal,
            metrics=metrics,
            dispatch=Dispatch(config, bus, nodes, journal),
            inflight=inflight,
            tokenizers=tokenizers or {},
        )
