"""A model node's KV planes, opened once at its start: its data-plane listener (with the
table of the transfers it asked for) and, unless disabled, its kvcache client, and what
is built over them (checkpoint uploaders, the keep-warm loop). The nodes' start-up code
asks here, so no module of a node imports the data plane or the kvcache client itself.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from shared.bus.client import Bus
from shared.bus.registry import NodeRegistry
from shared.kvclient.client import KVCacheClient
from shared.kvclient.tails import TailUploader
from shared.kvclient.uploader import BlockUploader
from shared.kvclient.warm import keep_warm
from shared.transport.base import ReceiveHandler, Transport
from shared.transport.pending import PendingTransfers, SplitHandler


@dataclass(frozen=True)
class CheckpointSettings:
    """A decode node's checkpoints (`--checkpoint-*`): every `every` filled blocks of a
    sequence, paced to `rate_mb` MB/s (0: unpaced); its partial last block stored at most
    every `tail_interval` seconds (None: not stored)."""

    every: int = 1
    rate_mb: float = 0.0
    tail_interval: float | None = 0.25


@dataclass
class KVPlanes:
    transport: Transport
    pending: PendingTransfers  # the kvcache replies this node asked for
    cache: KVCacheClient | None  # None: no kvcache service (--no-kvcache)

    @classmethod
    def open(
        cls, bus: Bus, transport: Transport, registry: NodeRegistry | None, kvcache: bool
    ) -> KVPlanes:
        pending = PendingTransfers()
        cache = KVCacheClient(bus, transport, pending, registry) if kvcache else None
        return cls(transport, pending, cache)

    @property
    def address(self) -> str:
        """Where this node's data plane listens (its registry entry says so)."""
        return self.transport.address

    @property
    def transport_name(self) -> str:
        return self.transport.name

    async def listen(self, announced: ReceiveHandler | None = None) -> None:
        """Start the listener: the transfers this node asked for, and (a decode node's
        receiver) those announced to it."""
        handler = self.pending if announced is None else SplitHandler(self.pending, announced)
        await self.transport.start(handler)

    def keep_warm(self, stop: asyncio.Event) -> asyncio.Task[None] | None:
        """Keep the kvcache nodes' connections open, so prefix loads' and checkpoints' first
        gets find them so (None without a kvcache service)."""
        if self.cache is None:
            return None
        return asyncio.create_task(keep_warm(self.cache, stop))

    def checkpoint_uploaders(
        self, settings: CheckpointSettings | None
    ) -> tuple[BlockUploader | None, TailUploader | None]:
        """What stores a decode node's filled blocks and tails (none without a kvcache
        service or with checkpoints off)."""
        if self.cache is None or settings is None or settings.every <= 0:
            return None, None
        blocks = BlockUploader(self.cache, rate=settings.rate_mb * 1e6)
        tails = None
        if settings.tail_interval is not None:
            tails = TailUploader(self.cache, settings.tail_interval)
        return blocks, tails
