"""The SLO policy (`--policy slo`): size each role from the planner's model of the load the
router sees, instead of reacting to thresholds once the SLO is already missed.

Each tick:
1. **The load.** The router's counters over a sliding `window` give the arrival rate
   (requests admitted) and the mean prompt and output lengths (of the requests served).
   The forecast `horizon` seconds ahead (about a node's start) is the rate of the
   window's second half plus the trend between its halves, never below that rate: a ramp
   is met before it arrives, a drop is believed only once it is seen. Jobs queued for
   prefill beyond what that rate explains at the TTFT target add the rate that drains
   them within the horizon.
2. **The size.** `Sizer` asks the planner's simulator (tandem/plan/simulate.py: the
   router's and the nodes' rules with this machine's profile) for the smallest prefill +
   decode counts within the bounds whose simulated SLO attainment at the forecast times
   (1 + `headroom`) meets the target; among equals, the best attainment. Results are
   cached per load, rounded to a few percent, so a steady load costs no simulation.
3. **The moves**, in replica space, without oscillating:
   - up to the size as soon as it has been above the count for `up_window` (nodes still
     loading count as there: capacity on its way is not asked for twice);
   - down one node at a time, only after the size has stayed below the count for
     `down_window`, not within `down_after_up` of a scale-up, and so only when the model
     says the smaller deployment meets the SLO with the headroom;
   - no decision before the window holds `min_span` seconds of the router's counts (a
     cold controller has no rate), nor from ticks while the router could not be read.
4. **Infeasible**: when even the maximum misses the SLO at the forecast, the size is the
   maximum, `infeasible` says so (the controller logs each change of it and exports it as
   a metric), and the policy holds there instead of thrashing.

The pure parts (forecast, moves) take time only from `Observation.time`, so a recorded
series replays exactly; the simulator is seeded.
"""

from __future__ import annotations

import argparse
import gc
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from tandem.autoscale.policy import choose_victims
from tandem.autoscale.types import ROLES, Decision, Observation, RoleBounds, Slo, SloConfig

STEP = 0.05  # loads within ~5% share a cached size
DOWN_MARGIN = 0.25  # a smaller deployment must meet the SLO at this much more load


@dataclass(frozen=True)
class Load:
    """What the deployment must serve: arrivals a second and their mean lengths."""

    rate: float
    prompt_tokens: int
    output_tokens: int

    def key(self) -> tuple[int, int, int]:
        """Rounded to steps of STEP (relative), so nearby loads share one simulation."""

        def step(x: float) -> int:
            return round(math.log(max(x, 1e-3)) / math.log1p(STEP))

        return step(self.rate), step(self.prompt_tokens), step(self.output_tokens)


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
        self._attainment: dict[tuple[tuple[int, int, int], int, int], float] = {}
        self._sizes: dict[tuple[int, int, int], Size] = {}
        self._leasts: dict[tuple[tuple[int, int, int], str], int] = {}  # (load, role) -> count
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
        argv = [
            "simulate", "--profile", self.profile, "--quiet",
            "--prefill", str(prefill), "--decode", str(decode),
            "--prompt-len", str(max(1, load.prompt_tokens)),
            "--output-len", str(max(1, load.output_tokens)),
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

    def size(self, load: Load) -> Size:
        """The fewest nodes meeting the SLO at `load` (ties: the best attainment); the
        maximum, marked infeasible, when none does."""
        key = load.key()
        if key in self._sizes:
            return self._sizes[key]
        found = self._between(key)
        if found is None:
            p, d = self.bounds["prefill"], self.bounds["decode"]
            most = self.attainment(load, p.max, d.max)
            if most < self.slo.attainment:
                found = Size(p.max, d.max, most, False)
            else:
                found = self._smallest(load)
        self._sizes[key] = found
        return found

    def _between(self, key: tuple[int, int, int]) -> Size | None:
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


@dataclass(frozen=True)
class _Count:
    time: float
    requests: float  # given a first token: what the mean lengths are per
    prompt_tokens: float
    output_tokens: float
    arrivals: float  # admitted: what the rate is of


class SloPolicy:
    """Stateful over calls; feed it every observation in time order (as `Policy`)."""

    def __init__(self, sizer: Sizer, config: SloConfig | None = None) -> None:
        self.sizer = sizer
        self.config = config or SloConfig()
        self._counts: deque[_Count] = deque()
        self._since: dict[tuple[str, str], float] = {}  # (role, "up"|"down") -> start
        self._last_up: dict[str, float] = {}
        self._pending_since: dict[str, float] = {}
        self.load: Load | None = None  # the last load planned for (forecast x headroom)
        self._lengths: tuple[int, int] | None = None  # mean prompt, output tokens lately
        self.size: Size | None = None  # and the size it needs
        self.infeasible = False
        self.why = ""  # what the last size rests on, for the infeasible log line

    # ---- the load ------------------------------------------------------------------------

    def _record(self, obs: Observation) -> None:
        if obs.router is None:
            return  # not read this tick: no gap filled with a guess
        c = obs.router
        if self._counts and c.arrivals < self._counts[-1].arrivals:
            self._counts.clear()  # the router restarted: its counters began again
        self._counts.append(
            _Count(obs.time, c.requests, c.prompt_tokens, c.output_tokens, c.arrivals)
        )
        while self._counts and obs.time - self._counts[0].time > self.config.window:
            self._counts.popleft()

    def forecast(self) -> Load | None:
        """The load to plan for, or None while the window is too short to tell."""
        counts, cfg = self._counts, self.config
        if len(counts) < 3 or counts[-1].time - counts[0].time < cfg.min_span:
            return None
        first, last = counts[0], counts[-1]
        middle = min(counts, key=lambda c: abs(c.time - (first.time + last.time) / 2))
        early = _rate(first, middle)
        late = _rate(middle, last)
        half = (last.time - first.time) / 2
        # A trend only where the halves' counts differ beyond Poisson noise (3 sigma): a
        # steady load's noise, extrapolated over the horizon, moved the size up and down.
        n1, n2 = middle.arrivals - first.arrivals, last.arrivals - middle.arrivals
        real = n2 - n1 > 3 * math.sqrt(max(n1 + n2, 1.0))
        trend = (late - early) / half if half > 0 and real else 0.0
        rate = max(late, late + trend * cfg.horizon) * (1 + cfg.headroom)
        if last.arrivals <= first.arrivals:
            return Load(0.0, 1, 1)
        done = last.requests - first.requests
        if done > 0:  # the lengths of the requests served in the window
            self._lengths = (
                round((last.prompt_tokens - first.prompt_tokens) / done),
                round((last.output_tokens - first.output_tokens) / done),
            )
        elif self._lengths is None:
            return None  # arrivals, none served yet: no lengths to size by
        return Load(rate, *self._lengths)  # (none served this window: the last known)

    # ---- the moves -----------------------------------------------------------------------

    def observe(self, obs: Observation, current: Mapping[str, int]) -> list[Decision]:
        if obs.router is None:
            return []  # the router was not read: no move on what may be stale
        self._record(obs)
        load = self.forecast()
        if load is None:
            return []
        load = self._with_backlog(load, obs.prefill_queue)
        size = self.sizer.size(load) if load.rate > 0 else self._smallest()
        # Hysteresis in replica space: fewer nodes only if they would still do at a load
        # DOWN_MARGIN above the one planned for (a load between the two moves nothing).
        wider = Load(load.rate * (1 + DOWN_MARGIN), load.prompt_tokens, load.output_tokens)
        keep = self.sizer.size(wider) if load.rate > 0 else size
        self.load, self.size = load, size
        self.infeasible = not size.feasible
        self.why = f"{load_text(load)}: simulated SLO met {size.attainment:.0%} at the maximum"
        decisions = []
        for role in ROLES:
            if role not in current:
                continue
            decision = self._decide(role, obs, current[role], size, keep)
            if decision is not None:
                if decision.delta > 0:
                    self._last_up[role] = obs.time
                self._since.pop((role, "up"), None)
                self._since.pop((role, "down"), None)
                decisions.append(decision)
        return decisions

    def _with_backlog(self, load: Load, queued: int) -> Load:
        """`load`, plus what it takes to drain the prefill queue's excess within the
        horizon. A deployment that fell behind (a ramp faster than nodes start) holds more
        jobs than the arrival rate at the TTFT target explains (rate x target, by Little's
        law); sized from arrivals alone, it stayed behind: every queued request missed its
        TTFT while the size matched the rate (a simulated H100 day met the SLO for 14%)."""
        excess = queued - load.rate * self.sizer.slo.ttft
        if excess <= 0 or load.rate <= 0:
            return load
        drain = excess / max(self.config.horizon, 1.0)
        return Load(load.rate + drain, load.prompt_tokens, load.output_tokens)

    def _smallest(self) -> Size:
        b = self.sizer.bounds
        return Size(b["prefill"].min, b["decode"].min, 1.0, True)

    def _decide(
        self, role: str, obs: Observation, count: int, size: Size, keep: Size
    ) -> Decision | None:
        """Toward `size`; down only to what `keep` (the size at a load DOWN_MARGIN higher)
        still allows."""
        cfg, now = self.config, obs.time
        bounds = self.sizer.bounds[role]
        want = min(max(size.of(role), bounds.min), bounds.max)
        if want < count:
            want = min(max(keep.of(role), want), count)
        why = (
            f"{role}: the planner sizes {load_text(self.load)} at {size.prefill}P+{size.decode}D "
            f"(simulated SLO met {size.attainment:.0%}"
            + ("" if size.feasible else "; infeasible even at the maximum: holding it")
            + ")"
        )
        serving = obs.serving(role)
        if len(serving) >= count:
            self._pending_since.pop(role, None)
        if want > count:
            self._since.pop((role, "down"), None)
            started = self._since.setdefault((role, "up"), now)
            loading = self._capacity_on_its_way(role, now, count, len(serving))
            if now - started >= cfg.up_window and not loading:
                return Decision(role, want - count, why)
            return None
        self._since.pop((role, "up"), None)
        if want < count:
            started = self._since.setdefault((role, "down"), now)
            recent_up = now - self._last_up.get(role, -math.inf) < cfg.down_after_up
            if now - started >= cfg.down_window and not recent_up and serving:
                victims = choose_victims(serving, 1)
                return Decision(role, -1, why, tuple(v.node_id for v in victims))
            return None
        self._since.pop((role, "down"), None)
        return None

    def _capacity_on_its_way(self, role: str, now: float, count: int, serving: int) -> bool:
        """Started nodes not serving yet, within the grace after the scale-up that asked."""
        if serving >= count:
            return False
        since = self._pending_since.setdefault(role, now)
        return now - since < self.config.startup_grace


def _rate(a: _Count, b: _Count) -> float:
    return (b.arrivals - a.arrivals) / (b.time - a.time) if b.time > a.time else 0.0


def load_text(load: Load | None) -> str:
    if load is None:
        return "no load yet"
    return (
        f"{load.rate:.3g} req/s of {load.prompt_tokens} prompt + {load.output_tokens} output tokens"
    )
