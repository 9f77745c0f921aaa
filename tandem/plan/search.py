"""`tandem plan search`: the cheapest deployment that meets a workload's SLOs, by simulation.

Every candidate within the node budget is simulated on the workload (simulator.py, the
same requests for each): colocated N (N decode nodes prefilling their own requests) for
N = 1..budget, and P prefill + D decode nodes for P + D <= budget. A node is the unit the
profile measured (a core of this machine with `--threads 1`, a GPU node with a
projection); every node of every candidate runs with that one profile.

For each candidate: its goodput (the highest rate of the sweep — the workload's
`--request-rate` list, default its target rate times 0.25 ... 2 — at which the share of
requests meeting both SLOs stays at or above `--slo-attainment`), goodput per node, its
attainment at the target rate (the highest `--request-rate`) and which SLO binds there.
The recommendation: the fewest nodes meeting the target; among equals, the most goodput.
It is printed as `tandem up` flags and as compose replica counts.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from shared.runtime.options import STEP_TOKEN_BUDGET, add_option, env_name
from tandem.bench.cli import Defaults, add_common_options
from tandem.bench.metrics import (
    RequestRecord,
    Slo,
    goodput,
    meets_tpot,
    meets_ttft,
    run_metrics,
)
from tandem.bench.report import write_json
from tandem.bench.serve import check, slo_of
from tandem.plan import compiled, simulate
from tandem.plan.topology import Arrival, Topology

DEFAULTS = Defaults("tandem-plan-search.json", 200, "1", None, 2.0, 0.1)
SWEEP_FACTORS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("search", help="the cheapest deployment meeting the SLOs, simulated")
    simulate.add_deployment_options(p)
    add_common_options(p, DEFAULTS)
    add_option(p, "--max-nodes", type=int, default=8, help="node budget (%(default)s)")
    p.set_defaults(func=run)


@dataclass
class Candidate:
    colocated: int = 0
    prefill: int = 0
    decode: int = 0
    goodput: float | None = None
    attainment: float = 0.0  # at the target rate
    ttft_met: float = 0.0  # shares meeting each SLO at the target rate
    tpot_met: float = 0.0

    @property
    def nodes(self) -> int:
        return self.colocated or self.prefill + self.decode

    @property
    def name(self) -> str:
        return (
            f"colocated x{self.colocated}" if self.colocated else f"{self.prefill}P:{self.decode}D"
        )

    def binds(self, slo: Slo) -> str:
        """The SLO the fewest requests meet at the target rate ("-" if both are met)."""
        if min(self.ttft_met, self.tpot_met) >= slo.attainment:
            return "-"
        return "TTFT" if self.ttft_met <= self.tpot_met else "TPOT"

    def up_flags(self, router: dict[str, str]) -> str:
        """`tandem up` with this deployment and (split ones) the `router` settings."""
        if self.colocated:
            return f"tandem up --colocated --decode {self.colocated}"
        extra = "".join(
            f" {flag} {value}" if value else f" {flag}" for flag, value in router.items()
        )
        return f"tandem up --prefill {self.prefill} --decode {self.decode}{extra}"

    def compose_env(self, router: dict[str, str]) -> str:
        if self.colocated:
            return (
                f"PREFILL_REPLICAS=0 DECODE_REPLICAS={self.colocated} TANDEM_COLOCATED=1"
                f" TANDEM_STEP_TOKEN_BUDGET={STEP_TOKEN_BUDGET}"
            )
        extra = "".join(f" {env_name(flag)}={value or 1}" for flag, value in router.items())
        return f"PREFILL_REPLICAS={self.prefill} DECODE_REPLICAS={self.decode}{extra}"


def router_settings(args: argparse.Namespace) -> dict[str, str]:
    """The router flags a split recommendation needs to route as simulated: conditional
    disaggregation with the profile's costs (and the TPOT target), when searched with it."""
    if not args.conditional:
        return {}
    out = {"--conditional": "", "--profile": args.profile}
    if args.tpot_target:
        out["--tpot-target"] = f"{args.tpot_target:g}"
    return out


def candidates(budget: int) -> Iterator[Candidate]:
    for n in range(1, budget + 1):
        yield Candidate(colocated=n)
        for p in range(1, n):
            yield Candidate(prefill=p, decode=n - p)


def shares(records: list[RequestRecord], slo: Slo) -> tuple[float, float]:
    """Shares of all requests meeting the TTFT and the TPOT target (failures meet neither)."""
    if not records:
        return 0.0, 0.0
    ok = [r for r in records if r.ok]
    ttft_ok = sum(1 for r in ok if meets_ttft(r, slo))
    tpot_ok = sum(1 for r in ok if meets_tpot(r, slo))
    return ttft_ok / len(records), tpot_ok / len(records)


def rates_of(args: argparse.Namespace) -> tuple[float, list[float]]:
    """The target rate and the sweep that measures goodput."""
    given = [r for r in args.request_rate if r is not None]
    if not given:
        raise ValueError("search needs a request rate (not inf): the load to plan for")
    target = max(given)
    sweep = sorted(set(given)) if len(given) > 1 else [target * f for f in SWEEP_FACTORS]
    return target, sweep


@dataclass
class Planner:
    """The deployment options every candidate is simulated with, and what it is judged by."""

    base: simulate.Deployment
    slo: Slo
    target: float
    concurrency: int | None
    step_budget: int | None = None  # the decode nodes' if given, else each candidate's default

    @classmethod
    def of(cls, args: argparse.Namespace, target: float) -> Planner:
        deployment = simulate.Deployment.of(args)
        return cls(deployment, slo_of(args), target, args.concurrency, args.step_token_budget)

    def topology(self, cand: Candidate) -> Topology:
        """The candidate's deployment, its decode nodes with the step budget given, else
        with `tandem up`'s default for it (colocated or split)."""
        budget = simulate.decode_budget(self.step_budget, cand.colocated)
        return replace(
            self.base.topology,
            colocated=cand.colocated,
            prefill=cand.prefill,
            decode=cand.decode,
            decode_engine=replace(self.base.topology.decode_engine, step_token_budget=budget),
        )

    def evaluate(self, cand: Candidate, workload: dict[float, list[Arrival]]) -> None:
        """Simulate the candidate at every rate: its goodput, and how it fares at the target."""
        topology = self.topology(cand)
        points = []
        for rate, arrivals in workload.items():
            records = self.base.run(arrivals, self.concurrency, topology=topology)
            m = run_metrics(records, self.slo)
            points.append((rate, m.slo_attainment))
            if rate == self.target:
                cand.attainment = m.slo_attainment
                cand.ttft_met, cand.tpot_met = shares(records, self.slo)
        cand.goodput = goodput(points, self.slo.attainment)


def arrivals_by_rate(args: argparse.Namespace, rates: list[float]) -> dict[float, list[Arrival]]:
    probe = argparse.Namespace(**{**vars(args), "request_rate": rates})
    return dict(zip(rates, (a for _, a in simulate.workload_points(probe)), strict=True))


def table(cands: list[Candidate], slo: Slo, target: float) -> str:
    lines = [
        f"| deployment | nodes | goodput req/s | per node | SLO met at {target:g} req/s | binds |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for c in cands:
        good = "-" if c.goodput is None else f"{c.goodput:.3g}"
        per = "-" if c.goodput is None else f"{c.goodput / c.nodes:.3g}"
        lines.append(
            f"| {c.name} | {c.nodes} | {good} | {per} | {c.attainment:.0%} | {c.binds(slo)} |"
        )
    return "\n".join(lines)


def recommend(cands: list[Candidate], slo: Slo) -> Candidate | None:
    meeting = [c for c in cands if c.attainment >= slo.attainment]
    if not meeting:
        return None
    return min(meeting, key=lambda c: (c.nodes, -(c.goodput or 0.0), c.colocated == 0))


def run(args: argparse.Namespace) -> int:
    problem = check(args) or simulate.deployment_problem(args, nodes_given=False)
    if problem is None and args.max_nodes < 1:
        problem = "--max-nodes must be at least 1"
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        target, sweep = rates_of(args)
        planner = Planner.of(args, target)
        workload = arrivals_by_rate(args, sweep)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cands = list(candidates(args.max_nodes))
    if not args.quiet:
        print(f"[search] {compiled.describe()}", file=sys.stderr)
    for i, cand in enumerate(cands, 1):
        planner.evaluate(cand, workload)
        if not args.quiet:
            print(f"[search] {i}/{len(cands)} {cand.name}", file=sys.stderr)
    print(table(cands, planner.slo, target))
    best = recommend(cands, planner.slo)
    write_json(Path(args.output), document(args, planner, sweep, cands, best))
    if best is None:
        print(
            f"\nno deployment of at most {args.max_nodes} nodes meets the SLOs at {target:g} req/s"
        )
    else:
        print(f"\nrecommended: {best.name} ({best.nodes} nodes, goodput {best.goodput:g} req/s)")
        print(f"  {best.up_flags(router_settings(args))}")
        print(f"  {best.compose_env(router_settings(args))} docker compose up")
    print(f"wrote {args.output}")
    return 0 if best is not None else 1


def document(
    args: argparse.Namespace,
    planner: Planner,
    sweep: list[float],
    cands: list[Candidate],
    best: Candidate | None,
) -> dict[str, Any]:
    return {
        "tool": "tandem plan search",
        "profile": args.profile,
        "target_rate": planner.target,
        "sweep_rates": sweep,
        "slo": asdict(planner.slo),
        "candidates": [
            {
                "deployment": c.name,
                "nodes": c.nodes,
                "goodput": c.goodput,
                "goodput_per_node": None if c.goodput is None else c.goodput / c.nodes,
                "attainment": c.attainment,
                "binds": c.binds(planner.slo),
            }
            for c in cands
        ],
        "recommendation": None
        if best is None
        else {
            "deployment": best.name,
            "up": best.up_flags(router_settings(args)),
            "compose": best.compose_env(router_settings(args)),
        },
    }
