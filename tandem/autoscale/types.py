"""What the autoscaler sees and decides: the contract between policy, controller, backends.

The controller samples the cluster (node registry heartbeats, the prefill queue, the
router's TTFT) into an `Observation` every tick; the `Policy` turns a series of them into
`Decision`s; a `Backend` carries them out (start nodes; drain and stop chosen ones).
"""

from __future__ import annotations

from collections.abc import Mapping
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
class RouterCounts:
    """The router's cumulative counts (its /metrics) for the pool: requests given a first
    token, their prompt tokens, the output tokens of those that ended, and the requests it
    admitted (routed). The arrival rate is read from the last: requests given a first token
    are capped by what the deployment serves, and an overloaded one, sized from them, saw
    its load fall as it fell behind (a simulated day collapsed to 1 prefill node at its
    peak)."""

    requests: float
    prompt_tokens: float
    output_tokens: float
    arrivals: float
    prompt_sq: float = 0.0  # sums of the squares of the lengths: their spread
    output_sq: float = 0.0


@dataclass(frozen=True)
class Observation:
    time: float  # seconds (monotonic)
    nodes: list[NodeSample] = field(default_factory=list)
    prefill_queue: int = 0  # jobs waiting in the prefill work queue
    ttft_p90: float | None = None  # seconds, over the last interval; None: no requests
    router: RouterCounts | None = None  # None: no router URL, or it could not be read

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


@dataclass(frozen=True)
class Slo:
    ttft: float  # seconds
    tpot: float  # seconds a token after the first
    attainment: float = 0.99  # share of requests meeting both


@dataclass(frozen=True)
class SloConfig:
    """Timings in seconds of `Observation.time`."""

    window: float = 60.0  # arrivals are counted over this long
    min_span: float = 10.0  # no decision before the window holds this much
    horizon: float = 30.0  # the forecast looks this far ahead (a node's start)
    headroom: float = 0.2  # plan for the forecast times 1 + this
    up_window: float = 2.0  # a larger size must hold this long
    down_window: float = 60.0  # a smaller size must hold this long
    down_after_up: float = 60.0  # per role: no scale-down this soon after a scale-up
    # Seconds a size is planned to hold: the forecast looks this much beyond the horizon,
    # a role scales up again within it only when the load outruns the last plan, and
    # scales down every spare node at once. 0: sized for the horizon, down one at a time.
    interval: float = 0.0
    bounds: Mapping[str, RoleBounds] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("window", "min_span", "horizon", "up_window", "down_window", "interval"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 seconds")
        if self.min_span > self.window:
            raise ValueError(f"min_span {self.min_span} exceeds the window {self.window}")
        if not 0 <= self.headroom <= 10:
            raise ValueError(f"headroom must be between 0 and 10, got {self.headroom}")
