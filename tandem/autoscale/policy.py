"""The seed scaling policy: turn a series of `Observation`s into `Decision`s, without flapping.

Decode scales on running sequences and KV-block use per node, prefill on queue depth per
node and the router's TTFT p90. Hysteresis comes from three things together: separate
high/low thresholds (a load between them changes nothing), conditions that must hold for a
sustained window (short up, long down), and per-role cooldowns (no second change in one
direction soon after the first, no scale-down soon after a scale-up). The policy is pure
and stateful over calls: it remembers when each condition began to hold and when each role
last changed; time comes only from `Observation.time`, so recorded series replay exactly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from tandem.autoscale.types import ROLES, Decision, NodeSample, Observation, RoleBounds


def _default_bounds() -> dict[str, RoleBounds]:
    return {role: RoleBounds() for role in ROLES}


@dataclass(frozen=True)
class PolicyConfig:
    """Thresholds and timings; every time is in seconds of `Observation.time`."""

    # Decode up: mean running sequences per serving node ≥ this, or KV use ≥ kv_used_high.
    decode_running_high: float = 8.0
    kv_used_high: float = 0.80
    # Decode down: with one node fewer (running / (n-1), used blocks / the others' blocks)
    # running per node would stay ≤ this AND KV use ≤ kv_used_low.
    decode_running_low: float = 2.0
    kv_used_low: float = 0.50
    # Prefill up: queued jobs per serving prefill node ≥ this, or TTFT p90 ≥ ttft_high.
    queue_high: float = 4.0
    ttft_high: float = 2.0
    # Prefill down: queue empty AND (no TTFT sample or TTFT p90 ≤ this).
    ttft_low: float = 0.5
    up_window: float = 3.0  # an up condition must hold this long
    down_window: float = 20.0  # a down condition must hold this long
    cooldown: float = 10.0  # per role: after a change, no next change in the same direction
    down_after_up: float = 30.0  # per role: no scale-down this soon after a scale-up
    # Started nodes that have not registered yet are capacity on its way: no further change
    # while they load, unless they are still missing this long after the last scale-up.
    startup_grace: float = 120.0
    # One scale-up adds enough nodes to bring the load per node down to the high threshold,
    # at least 1 and at most this many (never past the role's max).
    max_step: int = 2
    bounds: Mapping[str, RoleBounds] = field(default_factory=_default_bounds)

    def __post_init__(self) -> None:
        # A low threshold at or above its high one would let the two conditions alternate.
        pairs = [
            ("decode_running", self.decode_running_low, self.decode_running_high),
            ("kv_used", self.kv_used_low, self.kv_used_high),
            ("ttft", self.ttft_low, self.ttft_high),
        ]
        for name, low, high in pairs:
            if not low < high:
                raise ValueError(f"{name}: low threshold {low} must be below high {high}")
        if self.max_step < 1:
            raise ValueError(f"max_step must be ≥ 1, got {self.max_step}")
        for role, b in self.bounds.items():
            if not 0 <= b.min <= b.max:
                raise ValueError(f"{role}: bounds need 0 ≤ min ≤ max, got {b.min}..{b.max}")

    def bounds_for(self, role: str) -> RoleBounds:
        return self.bounds.get(role, RoleBounds())


def choose_victims(serving: list[NodeSample], k: int) -> list[NodeSample]:
    """The k nodes cheapest to remove: fewest running sequences (least to drain), ties to
    the highest node id (so repeated scale-downs pick deterministically)."""
    by_id = sorted(serving, key=lambda s: s.node_id, reverse=True)
    return sorted(by_id, key=lambda s: s.running)[:k]  # stable: keeps the id order on ties


@dataclass(frozen=True)
class _Load:
    """What the load of one role asks for at one instant (before windows and cooldowns)."""

    up: str | None = None  # why more nodes are needed
    step: int = 1  # how many more
    down: str | None = None  # why one node fewer would do
    victim: NodeSample | None = None


class Policy:
    """Stateful over calls; feed it every observation in time order."""

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()
        self._since: dict[tuple[str, str], float] = {}  # (role, "up"|"down") -> start
        self._last_up: dict[str, float] = {}
        self._last_down: dict[str, float] = {}
        self._pending_since: dict[str, float] = {}  # role -> when capacity was first awaited

    def observe(self, obs: Observation, current: Mapping[str, int]) -> list[Decision]:
        """Decisions for this tick, at most one per role. `current[role]` is the backend's
        count of nodes started and not asked to stop (including ones still loading); a role
        missing from it is another controller's to scale (a decode pool shared by models)."""
        decisions = []
        for role in ROLES:
            if role not in current:
                continue
            decision = self._decide(role, obs, current[role])
            if decision is not None:
                self._record(decision, obs.time)
                decisions.append(decision)
        return decisions

    def _decide(self, role: str, obs: Observation, count: int) -> Decision | None:
        cfg, bounds, now = self.config, self.config.bounds_for(role), obs.time
        serving = obs.serving(role)
        # Bounds first and unconditionally: they are the operator's word, not a load signal.
        if count < bounds.min:
            return Decision(
                role, bounds.min - count, f"{role}: below minimum ({count} < {bounds.min})"
            )
        if count > bounds.max:
            victims = choose_victims(serving, count - bounds.max)
            if victims:
                reason = f"{role}: above maximum ({count} > {bounds.max})"
                return Decision(role, -len(victims), reason, tuple(v.node_id for v in victims))
            return None
        if self._capacity_on_its_way(role, now, count, len(serving)):
            # Load measured now says nothing about the cluster once those nodes serve: drop
            # the evidence so it must build up again with them counted.
            self._forget(role)
            return None
        load = self._decode_load(serving) if role == "decode" else self._prefill_load(obs, serving)
        up_for = self._held(role, "up", load.up is not None, now)
        down_for = self._held(role, "down", load.down is not None, now)
        if (
            load.up is not None
            and up_for >= cfg.up_window
            and count < bounds.max
            and self._elapsed(self._last_up, role, now, cfg.cooldown)
        ):
            return Decision(
                role, min(load.step, bounds.max - count), f"{load.up} for {up_for:.0f}s"
            )
        if (
            load.down is not None
            and load.victim is not None
            and down_for >= cfg.down_window
            and count > bounds.min
            and self._elapsed(self._last_down, role, now, cfg.cooldown)
            and self._elapsed(self._last_up, role, now, cfg.down_after_up)
        ):
            victim = load.victim
            reason = (
                f"{load.down} for {down_for:.0f}s; removing {victim.node_id} "
                f"({victim.running} running)"
            )
            return Decision(role, -1, reason, (victim.node_id,))
        return None

    def _decode_load(self, serving: list[NodeSample]) -> _Load:
        cfg, n = self.config, len(serving)
        running = sum(s.running for s in serving)
        capacity = sum(s.total_kv_blocks for s in serving)
        used = capacity - sum(s.free_kv_blocks for s in serving)
        per_node = running / n if n else 0.0
        kv = used / capacity if capacity else 0.0
        up_reasons = []
        if n and per_node >= cfg.decode_running_high:
            up_reasons.append(
                f"{per_node:.1f} running per node ≥ {cfg.decode_running_high:g} ({n} nodes)"
            )
        if kv >= cfg.kv_used_high:
            up_reasons.append(f"KV use {kv:.2f} ≥ {cfg.kv_used_high:.2f}")
        if up_reasons:
            needed = max(
                math.ceil(running / cfg.decode_running_high), math.ceil(kv * n / cfg.kv_used_high)
            )
            step = min(max(needed - n, 1), cfg.max_step)
            return _Load(up="decode: " + " and ".join(up_reasons), step=step)
        victims = choose_victims(serving, 1)
        if not victims:
            return _Load()
        victim = victims[0]
        # Judged as if the victim were gone (its sequences and blocks land on the others):
        # the down threshold then guards the result, not the present.
        per_node_after = _share(running, n - 1)
        kv_after = _share(used, capacity - victim.total_kv_blocks)
        if per_node_after <= cfg.decode_running_low and kv_after <= cfg.kv_used_low:
            down = (
                f"decode: with {n - 1} nodes, {per_node_after:.1f} running per node "
                f"≤ {cfg.decode_running_low:g} and KV use {kv_after:.2f} ≤ {cfg.kv_used_low:.2f}"
            )
            return _Load(down=down, victim=victim)
        return _Load()

    def _prefill_load(self, obs: Observation, serving: list[NodeSample]) -> _Load:
        cfg, n = self.config, len(serving)
        queue, ttft = obs.prefill_queue, obs.ttft_p90
        per_node = queue / max(n, 1)
        up_reasons = []
        if per_node >= cfg.queue_high:
            up_reasons.append(
                f"queue {queue} ({per_node:.1f} per node) ≥ {cfg.queue_high:g} per node"
            )
        if ttft is not None and ttft >= cfg.ttft_high:
            up_reasons.append(f"TTFT p90 {ttft:.2f}s ≥ {cfg.ttft_high:.2f}s")
        if up_reasons:
            # A long queue says how many nodes it needs; a slow TTFT alone does not: one.
            step = min(max(math.ceil(queue / cfg.queue_high) - n, 1), cfg.max_step)
            return _Load(up="prefill: " + " and ".join(up_reasons), step=step)
        victims = choose_victims(serving, 1)
        if victims and queue == 0 and (ttft is None or ttft <= cfg.ttft_low):
            shown = "none" if ttft is None else f"{ttft:.2f}s"
            down = f"prefill: queue empty and TTFT p90 {shown} ≤ {cfg.ttft_low:.2f}s"
            return _Load(down=down, victim=victims[0])
        return _Load()

    def _capacity_on_its_way(self, role: str, now: float, count: int, serving: int) -> bool:
        if count <= serving:
            self._pending_since.pop(role, None)
            return False
        since = self._pending_since.setdefault(role, now)
        # Bounded: a node that never registers (crashed while loading) must not freeze the role.
        return now - since < self.config.startup_grace

    def _held(self, role: str, direction: str, holds: bool, now: float) -> float:
        """How long the condition has held without a break (0 when it does not hold)."""
        key = (role, direction)
        if not holds:
            self._since.pop(key, None)
            return 0.0
        return now - self._since.setdefault(key, now)

    @staticmethod
    def _elapsed(last: dict[str, float], role: str, now: float, span: float) -> bool:
        return role not in last or now - last[role] >= span

    def _forget(self, role: str) -> None:
        for direction in ("up", "down"):
            self._since.pop((role, direction), None)

    def _record(self, decision: Decision, now: float) -> None:
        # Evidence gathered with the old node count does not speak for the new one.
        self._forget(decision.role)
        if decision.delta > 0:
            self._last_up[decision.role] = now
            # The new nodes are awaited from now, even if older ones were awaited before.
            self._pending_since[decision.role] = now
        else:
            self._last_down[decision.role] = now


def _share(amount: int, among: int) -> float:
    """amount / among, where nothing shared among nothing is 0 and something is infinite."""
    if among > 0:
        return amount / among
    return 0.0 if amount == 0 else math.inf
