"""What the autoscaler sees and decides: the contract between policy, controller, backends.

The controller samples the cluster (node registry heartbeats, the prefill queue, the
router's TTFT) into an `Observation` every tick; the `Policy` turns a series of them into
`Decision`s; a `Backend` carries them out (start nodes; drain and stop chosen ones).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class NodeSample:
    node_id: str
    role: str  # prefill | decode
    running: int = 0  # sequences in the running batch (decode) or being prefilled
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    draining: bool = False

    @property
    def kv_used(self) -> float:
        """Share of the node's KV blocks in use, 0..1."""
        if self.total_kv_blocks <= 0:
            return 0.0
        return 1.0 - self.free_kv_blocks / self.total_kv_blocks


@dataclass(frozen=True)
class Observation:
    time: float  # seconds (monotonic)
    nodes: list[NodeSample] = field(default_factory=list)
    prefill_queue: int = 0  # jobs waiting in the prefill work queue
    ttft_p90: float | None = None  # seconds, over the last interval; None: no requests

    def serving(self, role: str) -> list[NodeSample]:
        """Nodes of a role that take work (draining ones are on their way out)."""
        return [n for n in self.nodes if n.role == role and not n.draining]


@dataclass(frozen=True)
class Decision:
    role: str
    delta: int  # +n: start n nodes; -n: drain and stop the nodes in `remove`
    reason: str
    remove: tuple[str, ...] = ()  # node ids chosen for removal (len == -delta)


@dataclass(frozen=True)
class RoleBounds:
    min: int = 1
    max: int = 4


class Backend(Protocol):
    """Where nodes run: local processes (what `tandem up` manages) or Docker."""

    def count(self, role: str) -> int:
        """Nodes of this role started and not yet asked to stop."""
        ...

    def scale_up(self, role: str, n: int) -> list[str]:
        """Start n more nodes of `role`; returns their node ids."""
        ...

    def scale_down(self, role: str, node_ids: list[str]) -> None:
        """Ask these nodes to stop gracefully (SIGTERM: drain, then exit). Returns at once."""
        ...
