"""Connections to the nodes a kvcache node answers, opened before a get needs them.

A get's blocks travel from the kvcache node to the asking node's data-plane listener, so
the first get from a node pays for the connection (~0.1 s with UCX on these machines), and
a failover's checkpoint load on a node that never loaded a prefix is exactly such a first
get. Every few seconds the kvcache node opens one pooled connection to each prefill and
decode node in the registry it has none to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from shared.bus.registry import NodeRegistry
from shared.transport.base import Transport

log = logging.getLogger("tandem.kvcache")

WARM_EVERY = 2.0  # seconds between looks at the registry
CONNECT_TIMEOUT = 5.0


async def keep_warm(registry: NodeRegistry, transport: Transport, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            nodes = list((await registry.nodes()).values())
        except Exception as exc:  # NATS away: try again later
            log.debug("registry not readable: %r", exc)
            nodes = []
        live = {n.data_address for n in nodes if n.role in ("prefill", "decode")}
        for address in sorted(live - {""}):  # warm() skips peers it has a live connection to
            if stop.is_set():
                return
            try:
                await asyncio.wait_for(transport.warm(address), CONNECT_TIMEOUT)
            except Exception as exc:  # unreachable now: the next round tries again
                log.debug("no connection to %s yet: %r", address, exc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), WARM_EVERY)
