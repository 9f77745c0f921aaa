"""Which connections a data-plane listener keeps: bounded, and strangers before peers.

Anyone who can reach a data port can connect; only a node told a transfer's secret over the
control plane can get a transfer admitted. A connection is a *stranger* until one of its
transfers passes the handler's admission (`prove`), and a *peer* afterwards (a pooled
connection of another node, which may sit idle between transfers for as long as it likes).
What a stranger may hold is bounded four ways:

- once it starts a frame, its whole header must arrive within `header_deadline` seconds
  (a slow trickle of header bytes holds nothing for long);
- it may stay silent at most `stranger_idle` seconds: every node sends its header the
  moment it connects (a connection kept ahead of need is opened by a one-byte transfer,
  `services/kvcache/warm.py`), so a silent connection is no node's and goes soon;
- at most `per_address` strangers per remote address and `max_strangers` in all: a new one
  beyond either evicts the oldest stranger (of its own address first), so a flood churns
  the flooder's own connections, and a peer's fresh connection, which sends its header
  within milliseconds, gets in even under one (all nodes of `tandem up` share 127.0.0.1);
- at most `max_connections` in all, peers included: past that a new connection is closed.

Peers are never evicted: there are as many as other nodes keep pooled (a few each).
Each limit can be set in the environment (`AdmissionLimits.from_env`), e.g.
`TANDEM_DATA_STRANGER_IDLE=10`.
"""

from __future__ import annotations

import asyncio
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, fields

HEADER_DEADLINE = 5.0
STRANGER_IDLE = 5.0
MAX_STRANGERS = 256
PER_ADDRESS = 64
MAX_CONNECTIONS = 1024


@dataclass
class AdmissionLimits:
    header_deadline: float = HEADER_DEADLINE
    stranger_idle: float = STRANGER_IDLE
    max_strangers: int = MAX_STRANGERS
    per_address: int = PER_ADDRESS
    max_connections: int = MAX_CONNECTIONS

    @classmethod
    def from_env(cls) -> AdmissionLimits:
        """The defaults, each overridden by `TANDEM_DATA_<FIELD>` when set (> 0)."""
        limits = cls()
        for f in fields(cls):
            raw = os.environ.get(f"TANDEM_DATA_{f.name.upper()}")
            if raw is None:
                continue
            try:
                value = float(raw) if f.type == "float" else int(raw)
            except ValueError:
                value = 0
            if value <= 0:
                raise ValueError(f"TANDEM_DATA_{f.name.upper()} must be a positive number")
            setattr(limits, f.name, value)
        return limits


@dataclass(eq=False)
class Connection:
    """One accepted connection as the listener sees it; `close` ends its serving task."""

    address: str
    close: Callable[[], object]
    peer: bool = False


class ConnectionTable:
    """The listener's connections; strangers in arrival order, for eviction."""

    def __init__(self, limits: AdmissionLimits | None = None) -> None:
        self.limits = limits or AdmissionLimits.from_env()
        self.strangers: OrderedDict[Connection, None] = OrderedDict()
        self.peers: set[Connection] = set()
        self.evicted = 0
        self.refused = 0

    def __len__(self) -> int:
        return len(self.strangers) + len(self.peers)

    def admit(self, address: str, close: Callable[[], object]) -> Connection | None:
        """Take a new connection from `address`, evicting strangers to make room; None if
        there is no room even so (the caller closes it)."""
        mine = [c for c in self.strangers if c.address == address]
        if len(mine) >= self.limits.per_address:
            self._evict(mine[0])
        elif len(self.strangers) >= self.limits.max_strangers:
            self._evict(next(iter(self.strangers)))
        if len(self) >= self.limits.max_connections:
            if not self.strangers:
                self.refused += 1
                return None
            self._evict(next(iter(self.strangers)))
        conn = Connection(address, close)
        self.strangers[conn] = None
        return conn

    def prove(self, conn: Connection) -> None:
        """One of its transfers was admitted: a peer from now on."""
        if self.strangers.pop(conn, 0) is None:
            conn.peer = True
            self.peers.add(conn)

    def remove(self, conn: Connection) -> None:
        self.strangers.pop(conn, None)
        self.peers.discard(conn)

    def idle_deadline(self, conn: Connection) -> float | None:
        """How long this connection may stay silent before a frame: bounded for a stranger."""
        return None if conn.peer else self.limits.stranger_idle

    def header_deadline(self, conn: Connection) -> float | None:
        """How long this connection may take over a header once it started one."""
        return None if conn.peer else self.limits.header_deadline

    def evict_oldest(self) -> bool:
        """Close the oldest stranger (the process ran out of descriptors); False if none."""
        if not self.strangers:
            return False
        self._evict(next(iter(self.strangers)))
        return True

    def _evict(self, conn: Connection) -> None:
        self.remove(conn)
        self.evicted += 1
        conn.close()


class AcceptBackoff:
    """Pauses after accept errors (out of file descriptors, out of memory): doubling from
    `first` to `longest`, reset by the next success, so a listener survives every error
    without spinning."""

    def __init__(self, first: float = 0.05, longest: float = 2.0) -> None:
        self.first = first
        self.longest = longest
        self.next = first
        self.errors = 0

    def ok(self) -> None:
        self.next = self.first

    async def failed(self) -> None:
        self.errors += 1
        await asyncio.sleep(self.next)
        self.next = min(self.next * 2, self.longest)
