"""Where a kvcache node may send blocks: the data-plane addresses of registered nodes.

A get (and a tail get, and a warm request) names the address the blocks go to. Any holder
of a node identity may send one, so without a check a compromised node could aim a kvcache
node's sends at any host and port it can reach (issue 49). A kvcache node sends only to an
address a prefill or decode node registered as its own data plane (draining ones too: they
still load checkpoints for the streams they finish).

The view is read from the registry when an address is not in it (a node that registered
since) or is older than `max_age`, at most once every `min_interval`, so a stream of gets
naming strangers costs one registry read a second, not one each. A registry that cannot be
read keeps the last view.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from shared.bus.messages import NodeInfo

SENDING_ROLES = ("prefill", "decode")
NOT_A_PEER = "the reply address is no registered node's data plane"


class Peers:
    def __init__(
        self,
        read: Callable[[], Awaitable[dict[str, NodeInfo]]],
        min_interval: float = 1.0,
        max_age: float = 30.0,
    ) -> None:
        """`read`: the registry's live entries (`NodeRegistry.nodes`)."""
        self._read = read
        self.min_interval = min_interval
        self.max_age = max_age
        self._addresses: frozenset[str] = frozenset()
        self._read_at = -float("inf")
        self._lock = asyncio.Lock()
        self.refused = 0

    async def allows(self, address: str) -> bool:
        """Whether `address` is a registered node's data plane (counted when not)."""
        now = time.monotonic()
        stale = now - self._read_at > self.max_age
        if (address not in self._addresses or stale) and now - self._read_at >= self.min_interval:
            await self._refresh()
        if address in self._addresses:
            return True
        self.refused += 1
        return False

    async def _refresh(self) -> None:
        async with self._lock:  # one read for the gets that missed together
            if time.monotonic() - self._read_at < self.min_interval:
                return
            self._read_at = time.monotonic()
            nodes = await self._read()
            if nodes:  # {}: not readable now (or nobody registered): keep the last view
                self._addresses = frozenset(
                    n.data_address
                    for n in nodes.values()
                    if n.role in SENDING_ROLES and n.data_address
                )
