"""A kvcache node's pins of running sequences' checkpoints (KVPin, KVUnpin).

A decode node pins the blocks of each checkpoint it records, for itself; a failover's next
node pins its own. A node's pins of a request are released when the request leaves it, all
nodes' when the request ends, and any node's when its lease runs out (the node died and no
failover took the request within the lease). At most a share of the memory tier is pinned,
so puts always find room.
"""

from __future__ import annotations

import time

from services.kvcache.store import MEMORY, BlockStore
from shared.runtime.cancels import RecentCancels

PIN_LEASE = 60.0
PINNABLE_SHARE = 0.5
MAX_PINNED_ATTEMPTS = 65536


class CheckpointPins:
    def __init__(self, store: BlockStore) -> None:
        self.store = store
        # attempt → decode node → (hashes it pinned, lease end)
        self.held: dict[str, dict[str, tuple[set[bytes], float]]] = {}
        # Ended requests: a pin that overtook its unpin (they are separate subscriptions)
        # must not pin them again.
        self.ended = RecentCancels(keep=PIN_LEASE)
        self.refused = 0

    def pin(self, attempt_id: str, node_id: str, hashes: list[bytes]) -> None:
        """Keep the stored ones of `hashes` for `attempt_id` on `node_id`'s behalf and renew
        the lease, within the share of memory that may be pinned."""
        if attempt_id in self.ended:
            return
        by_node = self.held.get(attempt_id)
        if by_node is None:
            if len(self.held) >= MAX_PINNED_ATTEMPTS:
                self.refused += 1
                return
            by_node = self.held[attempt_id] = {}
        held, _ = by_node.get(node_id, (set(), 0.0))
        new = [h for h in dict.fromkeys(hashes) if h not in held and h in self.store]
        room = self.store.limits[MEMORY] * PINNABLE_SHARE
        if self.store.pinned_bytes + sum(map(self.store.block_size, new)) > room:
            self.refused += 1
            new = []
        held.update(h for h in new if self.store.pin([h]))
        by_node[node_id] = (held, time.monotonic() + PIN_LEASE)

    def unpin(self, attempt_id: str, node_id: str, over: bool) -> None:
        """Release `node_id`'s pins of `attempt_id` (it left that node), or every node's
        (`over`: the request ended; a pin arriving late for it is ignored)."""
        by_node = self.held.get(attempt_id, {})
        if over:
            self.ended.add(attempt_id)
            nodes = list(by_node)
        else:
            nodes = [node_id] if node_id in by_node else []
        for node in nodes:
            held, _ = by_node.pop(node)
            self.store.unpin(held)
        if not by_node:
            self.held.pop(attempt_id, None)

    def expire(self) -> None:
        """Release the pins whose lease ran out (their node is gone, and no failover took
        the request over within the lease). Every heartbeat."""
        now = time.monotonic()
        for attempt_id, by_node in list(self.held.items()):
            for node in [n for n, (_, end) in by_node.items() if end < now]:
                held, _ = by_node.pop(node)
                self.store.unpin(held)
            if not by_node:
                del self.held[attempt_id]
