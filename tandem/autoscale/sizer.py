"""How many prefill and decode nodes a load needs to meet an SLO: the planner's simulator
(tandem/plan/simulate.py: the router's and the nodes' rules with a profile) asked at that
load, the answers cached per load rounded to a few percent. The SLO policy (slo.py) sizes
each tick's forecast with it; `tandem plan search` asks the same question of one
workload.

The search: from the last tick's size when there is one (`Sizer._near`: a simulation or
three), else bisection of each role's least count with the other at its maximum and a walk
up from their sum (`Sizer._smallest`); a load between two sized ones that need the same
deployment needs it too (`Sizer._between`).
"""

from __future__ import annotations

import argparse
import gc
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from tandem.autoscale.types import ROLES, RoleBounds, Slo

STEP = 0.05  # loads within ~5% share a cached size
NEAR_STEPS = 3  # nodes `Sizer._near` adds or removes before the search from the bounds


@dataclass(frozen=True)
class Load:
    """What the deployment must serve: arrivals a second, their mean lengths, and the
    spread of those lengths (the half-width of a uniform of the same variance; 0: all
    alike)."""

    rate: float
    prompt_tokens: int
    output_tokens: int
    prompt_spread: int = 0
    output_spread: int = 0

    def key(self) -> tuple[int, ...]:
        """Rounded to steps of STEP (relative; spreads in tenths of their mean), so
        nearby loads share one simulation. The rate comes first (`Sizer._between`)."""

        def step(x: float) -> int:
            return round(math.log(max(x, 1e-3)) / math.log1p(STEP))

        def tenths(spread: int, mean: int) -> int:
            return round(10 * spread / max(mean, 1))

        return (
            step(self.rate), step(self.prompt_tokens), step(self.output_tokens),
            tenths(self.prompt_spread, self.prompt_tokens),
            tenths(self.output_spread, self.output_tokens),
        )  # fmt: skip

    def lengths(self) -> tuple[str, str]:
        """`tandem plan simulate`'s --prompt-len and --output-len for this load, each of
        the same mean and variance: uniform over mean +- spread, or the mean alone.

        A spread wider than the mean (a mix of short and long, e.g. 20% of 1,500-token
        prompts among 100-token ones) fits no uniform from 1 up: it is the two lengths 1
        and L of that mean and variance instead. A uniform cut at 1 raised the mean (800
        -> 1,006 tokens for half long ones) and sized for work that was not there."""

        def spec(mean: int, spread: int) -> str:
            mean = max(1, mean)
            if spread <= 0 or mean == 1:
                return str(mean)
            if mean - spread >= 1:
                return f"uniform:{mean - spread}:{mean + spread}"
            above, variance = mean - 1, spread * spread / 3  # (a uniform's: half-width^2/3)
            share = above * above / (variance + above * above)  # of the long ones
            return f"mix:1:{1 + round(above / share)}:{share:.4f}"

        return spec(self.prompt_tokens, self.prompt_spread), spec(
            self.output_tokens, self.output_spread
        )

    def times(self, factor: float) -> Load:
        """The same lengths at `factor` times the rate."""
        return replace(self, rate=self.rate * factor)


@dataclass
class Size:
    """The deployment a load needs, and whether it meets the SLO at all."""

    prefill: int
    decode: int
    attainment: float
    feasible: bool

    def of(self, role: str) -> int:
        return self.prefill if role == "prefill" else self.decode


class Sizer:
    """The smallest prefill + decode counts that meet an SLO at a load, by simulation with
    a profile (the planner's model; `tandem plan search` asks the same question of a
    fixed workload)."""

    def __init__(
        self,
        profile: str,
        slo: Slo,
        bounds: Mapping[str, RoleBounds],
        node_options: Sequence[str] = (),
        requests: int = 60,
    ) -> None:
        from tandem.plan import simulate

        self.profile = profile
        self.slo = slo
        self.bounds = {role: bounds.get(role, RoleBounds()) for role in ROLES}
        self.node_options = list(node_options)
        self.requests = requests
        self._parser = argparse.ArgumentParser(prog="tandem plan")  # simulate's own options
        simulate.add_parser(self._parser.add_subparsers(dest="command"))
        self._attainment: dict[tuple[tuple[int, ...], int, int], float] = {}
        self._sizes: dict[tuple[int, ...], Size] = {}
        self._leasts: dict[tuple[tuple[int, ...], str], int] = {}  # (load, role) -> count
        self.simulations = 0  # how many were run (a cached load runs none)

    def attainment(self, load: Load, prefill: int, decode: int) -> float:
        """Simulated share of requests meeting the SLO on `prefill` + `decode` nodes."""
        key = (load.key(), prefill, decode)
        if key not in self._attainment:
            self._attainment[key] = self._simulate(load, prefill, decode)
        return self._attainment[key]

    def _simulate(self, load: Load, prefill: int, decode: int) -> float:
        from tandem.bench.metrics import run_metrics
        from tandem.bench.serve import slo_of
        from tandem.plan import simulate

        # Two minutes of arrivals, within bounds: a load near a deployment's capacity
        # builds its queue slowly, and a short run would call it served. A large cluster's
        # load gets at least 20 s of arrivals (8x `requests` is a blink at 300 req/s).
        longest = max(8 * self.requests, math.ceil(load.rate * 20))
        n = max(self.requests, min(longest, math.ceil(load.rate * 120)))
        prompt_len, output_len = load.lengths()
        argv = [
            "simulate", "--profile", self.profile, "--quiet",
            "--prefill", str(prefill), "--decode", str(decode),
            "--prompt-len", prompt_len, "--output-len", output_len,
            "--num-requests", str(n), "--request-rate", f"{max(load.rate, 1e-3):.6g}",
            "--slo-ttft", f"{self.slo.ttft:g}", "--slo-tpot", f"{self.slo.tpot:g}",
            "--slo-attainment", f"{self.slo.attainment:g}",
            *self.node_options,
        ]  # fmt: skip
        args = self._parser.parse_args(argv)
        deployment = simulate.Deployment.of(args)
        (_, arrivals), *_ = simulate.workload_points(args)
        self.simulations += 1
        records = deployment.run(arrivals, None, args.timeout)
        got = float(run_metrics(records, slo_of(args)).slo_attainment)
        del deployment, records
        if not gc.isenabled():
            # Sized from inside `tandem plan simulate --autoscale`, whose simulation runs
            # with the cyclic collector paused: this run's nodes and engines (which refer
            # to each other) would never be freed, some 30 MB a run, and a simulated hour
            # of a large cluster ran out of memory. The youngest generation holds only
            # what was made since the last such pass: a pass costs what was made since.
            gc.collect(0)
        return got

    def size(self, load: Load, near: Size | None = None) -> Size:
        """The fewest nodes meeting the SLO at `load` (ties: the best attainment); the
        maximum, marked infeasible, when none does. `near`: the size of a load like this
        one (the last tick's), searched from instead (`_near`)."""
        key = load.key()
        if key in self._sizes:
            return self._sizes[key]
        found = self._between(key)
        if found is None and near is not None and near.feasible:
            found = self._near(load, near)  # (None: the search from the bounds)
        if found is None:
            p, d = self.bounds["prefill"], self.bounds["decode"]
            most = self.attainment(load, p.max, d.max)
            if most < self.slo.attainment:
                found = Size(p.max, d.max, most, False)
            else:
                found = self._smallest(load)
        self._sizes[key] = found
        return found

    def _between(self, key: tuple[int, ...]) -> Size | None:
        """The size of a load whose rate lies between two sized ones of the same lengths,
        if it follows from them without a simulation: more load never needs fewer nodes,
        so when both sides need the same deployment, the load between does (it meets the
        SLO at the higher rate); past an infeasible rate, every rate is. A forecast moves
        by a step or two a tick; without this, nearly every tick simulated again."""
        lower = higher = None
        for other, size in self._sizes.items():
            if other[1:] != key[1:]:
                continue
            if other[0] < key[0] and (lower is None or other[0] > lower[0][0]):
                lower = (other, size)
            elif other[0] > key[0] and (higher is None or other[0] < higher[0][0]):
                higher = (other, size)
        if lower is not None and not lower[1].feasible:
            return lower[1]
        if lower is None or higher is None:
            return None
        below, above = lower[1], higher[1]
        if (below.prefill, below.decode, above.feasible) == (above.prefill, above.decode, True):
            return Size(above.prefill, above.decode, above.attainment, True)
        return None

    def _near(self, load: Load, start: Size) -> Size | None:
        """From a size known to suit a load like this one: fewer nodes of either role while
        the SLO is still met, or more of the role whose node helps most until it is (None
        when neither helps: which role is short is then not known here, or after
        NEAR_STEPS nodes: the load is not like the last, and bisection finds it sooner). A
        load moves a little a tick, so this takes a simulation or three where the search
        from the bounds (`_smallest`) takes a dozen; a simulated hour of a 64-node cluster
        sized a new load nearly every tick (its mix drifted), and spent an hour doing so."""
        p_bounds, d_bounds = self.bounds["prefill"], self.bounds["decode"]
        p = min(max(start.prefill, p_bounds.min), p_bounds.max)
        d = min(max(start.decode, d_bounds.min), d_bounds.max)
        target = self.slo.attainment
        got = self.attainment(load, p, d)
        if got >= target:
            for _ in range(NEAR_STEPS + 1):
                fewer = [(p - 1, d)] if p > p_bounds.min else []
                fewer += [(p, d - 1)] if d > d_bounds.min else []
                meeting = [(self.attainment(load, *c), c) for c in fewer]
                meeting = [(a, c) for a, c in meeting if a >= target]
                if not meeting:
                    return Size(p, d, got, True)
                got, (p, d) = max(meeting)
            return None
        for _ in range(NEAR_STEPS):
            more = [(p + 1, d)] if p < p_bounds.max else []
            more += [(p, d + 1)] if d < d_bounds.max else []
            if not more:
                return Size(p, d, got, False)  # the maximum misses it
            better, (p, d) = max((self.attainment(load, *c), c) for c in more)
            if better <= got:
                return None
            got = better
            if got >= target:
                return Size(p, d, got, True)
        return None

    def _smallest(self, load: Load) -> Size:
        """The fewest nodes meeting the SLO, the maximum known to meet it. A role's count
        cannot be below the least that meets it with the other role at its maximum (found
        by bisection: more nodes of a role never serve worse), so the search starts at the
        sum of those two and walks up: a few simulations where every split of every total
        would take hundreds on a 64-node cluster. The least counts of the loads sized
        before, at lower and higher rates, bound the bisection (they only grow with the
        rate)."""
        p, d = self.bounds["prefill"], self.bounds["decode"]
        least_p = self._least(load, "prefill", lambda n: self.attainment(load, n, d.max))
        least_d = self._least(load, "decode", lambda n: self.attainment(load, p.max, n))
        for total in range(least_p + least_d, p.max + d.max + 1):
            meeting = []
            for prefill in range(max(least_p, total - d.max), min(p.max, total - least_d) + 1):
                got = self.attainment(load, prefill, total - prefill)
                if got >= self.slo.attainment:
                    meeting.append(Size(prefill, total - prefill, got, True))
            if meeting:
                return max(meeting, key=lambda s: s.attainment)
        raise AssertionError("the maximum meets the SLO, so some total does")

    def _least(self, load: Load, role: str, attained: Callable[[int], float]) -> int:
        """The smallest count of `role` whose attainment meets the target, given that its
        maximum does."""
        key = load.key()
        lo, hi = self.bounds[role].min, self.bounds[role].max
        for (other, of), least in self._leasts.items():
            if of == role and other[1:] == key[1:]:
                if other[0] <= key[0]:
                    lo = max(lo, least)
                if other[0] >= key[0]:
                    hi = min(hi, least)
        hi = max(lo, hi)
        while lo < hi:
            mid = (lo + hi) // 2
            if attained(mid) >= self.slo.attainment:
                hi = mid
            else:
                lo = mid + 1
        self._leasts[(key, role)] = lo
        return lo
