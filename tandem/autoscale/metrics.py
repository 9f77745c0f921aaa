"""The autoscaler's own metrics (`--scale-metrics-port`): what it runs, what it decided, and
whether the SLO policy finds its target reachable at all, per pool (a model's, or "" for
every node), so a dashboard or an alert sees an infeasible SLO without reading logs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge

from tandem.autoscale.types import Decision


class AutoscaleMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.replicas = Gauge(
            "tandem_autoscale_replicas",
            "Nodes the backend runs (starting and draining ones too), by pool and role",
            ["pool", "role"],
            registry=r,
        )
        self.decisions = Counter(
            "tandem_autoscale_decisions_total",
            "Replica changes decided, by pool, role and direction (up, down)",
            ["pool", "role", "direction"],
            registry=r,
        )
        self.infeasible = Gauge(
            "tandem_autoscale_slo_infeasible",
            "1 while the SLO policy finds its target missed even at the maximum (it then "
            "holds the maximum), else 0",
            ["pool"],
            registry=r,
        )
        self.planned_rate = Gauge(
            "tandem_autoscale_planned_rate",
            "Requests a second the SLO policy last sized for (forecast times 1 + headroom)",
            ["pool"],
            registry=r,
        )

    def tick(
        self,
        pool: str,
        current: Mapping[str, int],
        decisions: Sequence[Decision],
        infeasible: bool,
        planned_rate: float | None,
    ) -> None:
        for role, count in current.items():
            self.replicas.labels(pool, role).set(count)
        for d in decisions:
            self.decisions.labels(pool, d.role, "up" if d.delta > 0 else "down").inc()
        self.infeasible.labels(pool).set(1.0 if infeasible else 0.0)
        if planned_rate is not None:
            self.planned_rate.labels(pool).set(planned_rate)
