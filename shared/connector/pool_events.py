"""An engine's block pool, as KV events: which blocks a node took in and evicted, published
on the bus for the routers' index (shared/bus/kv_events.py)."""

from __future__ import annotations

from shared.bus.kv_events import KVEventPublisher
from shared.engine.interface import EngineCore


class PoolEvents:
    """What an engine's block pool took in and evicted, as KV events of `publisher`.

    The engine names and evicts blocks on its own thread: they are collected there (`take`,
    on that thread, between engine calls) and published from the event loop (`publish`).
    """

    def __init__(self, engine: EngineCore, publisher: KVEventPublisher) -> None:
        self.publisher = publisher
        self._named: list[bytes] = []
        self._evicted: list[bytes] = []
        engine.exchange.on_blocks_named = lambda hashes: self._named.extend(
            hashes
        )  # the list rebinds
        engine.pool.on_evict = lambda _block, h: self._evicted.append(h)

    def take(self) -> tuple[list[bytes], list[bytes]]:
        """(evicted, named) since the last take."""
        evicted, self._evicted = self._evicted, []
        named, self._named = self._named, []
        return evicted, named

    def publish(self, evicted: list[bytes], named: list[bytes]) -> None:
        self.publisher.evicted(evicted)  # evictions first: a block may be evicted and reused
        self.publisher.stored(named)
