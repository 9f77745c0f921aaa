"""The SLO policy (`--policy slo`): size each role from the planner's model of the load the
router sees, instead of reacting to thresholds once the SLO is already missed.

Each tick:
1. **The load.** The router's counters over a sliding `window` give the arrival rate
   (requests admitted) and the mean prompt and output lengths of the requests served,
   and their spread (from sums of squares), from the window's second half when it holds
   enough of them.
   The forecast `horizon` seconds ahead (about a node's start) is the rate of the
   window's second half plus the trend between its halves, never below that rate: a ramp
   is met before it arrives, a drop is believed only once it is seen. Jobs queued for
   prefill beyond what that rate explains at the TTFT target add the rate that drains
   them within the horizon.
2. **The size.** `Sizer` (sizer.py) asks the planner's simulator (the router's and the
   nodes' rules with this machine's profile) for the smallest prefill + decode counts
   within the bounds whose simulated SLO attainment at the forecast times
   (1 + `headroom`), lengths spread as observed, meets the target; searched from the
   last tick's size.
3. **The moves**, in replica space, without oscillating:
   - up to the size as soon as it has been above the count for `up_window` (nodes still
     loading count as there: capacity on its way is not asked for twice);
   - down one node at a time, only after the size has stayed below the count for
     `down_window`, not within `down_after_up` of a scale-up, and so only when the model
     says the smaller deployment meets the SLO with the headroom;
   - with an `interval` (seconds a size is planned to hold): the trend is read over the
     interval (over a longer span a real one stands out of the noise sooner), the forecast
     looks that much further ahead, a scale-up within the interval of the role's last
     change comes only when the load without that look ahead outruns what the change was
     sized for, and a scale-down removes every spare node at once: fewer, larger changes
     for some node-seconds more (a tick where no role can move sizes nothing);
   - no decision before the window holds `min_span` seconds of the router's counts (a
     cold controller has no rate), nor from ticks while the router could not be read.
4. **Infeasible**: when even the maximum misses the SLO at the forecast, the size is the
   maximum, `infeasible` says so (the controller logs each change of it and exports it as
   a metric) until sizes have been feasible for `down_window`, and the policy holds there
   instead of thrashing.

The pure parts (forecast, moves) take time only from `Observation.time`, so a recorded
series replays exactly; the simulator is seeded.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, replace

from tandem.autoscale.policy import choose_victims
from tandem.autoscale.sizer import Load, Size, Sizer
from tandem.autoscale.types import ROLES, Decision, Observation, SloConfig

DOWN_MARGIN = 0.25  # a smaller deployment must meet the SLO at this much more load
LENGTH_SAMPLE = 20  # requests served in the window's second half to read lengths from


@dataclass(frozen=True)
class _Count:
    time: float
    requests: float  # given a first token: what the mean lengths are per
    prompt_tokens: float
    output_tokens: float
    arrivals: float  # admitted: what the rate is of
    prompt_sq: float  # sums of squares: the spread of the lengths
    output_sq: float


class SloPolicy:
    """Stateful over calls; feed it every observation in time order (as `Policy`)."""

    def __init__(self, sizer: Sizer, config: SloConfig | None = None) -> None:
        self.sizer = sizer
        self.config = config or SloConfig()
        self._counts: deque[_Count] = deque()
        self._since: dict[tuple[str, str], float] = {}  # (role, "up"|"down") -> start
        self._last_change: dict[str, float] = {}
        # per role: no scale-down before this time (the interval after any change, and
        # `down_after_up` after a scale-up)
        self._no_down_until: dict[str, float] = {}
        # per role: the demand (tokens/s) its last change was sized for; a scale-up
        # within the interval only when the demand without the look ahead outruns it
        self._planned: dict[str, float] = {}
        self.load: Load | None = None  # the last load planned for (forecast x headroom)
        # mean prompt and output tokens lately, and their spreads (Load's fields)
        self._lengths: tuple[int, int, int, int] | None = None
        self.size: Size | None = None  # and the size it needs
        self.infeasible = False
        self._feasible_since: float | None = None  # while infeasible: sized feasibly since
        self.why = ""  # what the last size rests on, for the infeasible log line

    # ---- the load ------------------------------------------------------------------------

    def _record(self, obs: Observation) -> None:
        if obs.router is None:
            return  # not read this tick: no gap filled with a guess
        c = obs.router
        if self._counts and c.arrivals < self._counts[-1].arrivals:
            self._counts.clear()  # the router restarted: its counters began again
        self._counts.append(
            _Count(obs.time, c.requests, c.prompt_tokens, c.output_tokens, c.arrivals,
                   c.prompt_sq, c.output_sq)
        )  # fmt: skip
        while self._counts and obs.time - self._counts[0].time > self._span():
            self._counts.popleft()

    def _span(self) -> float:
        """Seconds of counts kept: the window, or the interval when that is longer (the
        trend is read over it)."""
        return max(self.config.window, self.config.interval)

    def forecast(self) -> Load | None:
        """The load to plan for, or None while the window is too short to tell."""
        ahead = self._forecast()
        return None if ahead is None else ahead[0]

    def _forecast(self) -> tuple[Load, float] | None:
        """`forecast`, and the rate it has without the interval's look ahead."""
        if not self._counts:
            return None
        cfg, end = self.config, self._counts[-1].time
        counts = [c for c in self._counts if end - c.time <= cfg.window]
        if len(counts) < 3 or counts[-1].time - counts[0].time < cfg.min_span:
            return None
        first, last = counts[0], counts[-1]
        middle = _middle(counts)
        late = _rate(middle, last)
        # ahead by a node's start, and by the interval the size is to hold (a trend
        # only ever raises the rate: a drop is believed once it is seen)
        trend = _trend(list(self._counts))  # kept over the window or the longer interval
        rate = max(late, late + trend * (cfg.horizon + cfg.interval)) * (1 + cfg.headroom)
        near = max(late, late + trend * cfg.horizon) * (1 + cfg.headroom)
        if last.arrivals <= first.arrivals:
            return Load(0.0, 1, 1), near
        # The lengths of the requests served in the window's second half when it has
        # enough of them (a shifting mix is seen half a window sooner), else in all of it.
        for since in (middle, first):
            if last.requests - since.requests >= (LENGTH_SAMPLE if since is middle else 1):
                self._lengths = _lengths(since, last)
                break
        else:
            if self._lengths is None:
                return None  # arrivals, none served yet: no lengths to size by
        return Load(rate, *self._lengths), near  # (none served this window: the last known)

    # ---- the moves -----------------------------------------------------------------------

    def observe(self, obs: Observation, current: Mapping[str, int]) -> list[Decision]:
        if obs.router is None:
            return []  # the router was not read: no move on what may be stale
        self._record(obs)
        ahead = self._forecast()
        if ahead is None:
            return []
        load, near_rate = ahead
        drain = self._drain(near_rate, obs.prefill_queue)
        load = replace(load, rate=load.rate + drain)
        near = _demand(replace(load, rate=near_rate + drain))  # without the look ahead
        if self._held(obs.time, current, near):
            return []
        last = self.size
        size = self.sizer.size(load, last) if load.rate > 0 else self._smallest()
        size = self._as_deployed(load, size, current)
        # Hysteresis in replica space: fewer nodes only if they would still do at a load
        # DOWN_MARGIN above the one planned for (a load between the two moves nothing).
        wider = load.times(1 + DOWN_MARGIN)
        keep = self.sizer.size(wider, size) if load.rate > 0 else size
        self.load, self.size = load, size
        self._note_feasible(size.feasible, obs.time)
        self.why = f"{load_text(load)}: simulated SLO met {size.attainment:.0%} at the maximum"
        decisions = []
        for role in ROLES:
            if role not in current:
                continue
            decision = self._decide(role, obs, current[role], size, keep, near)
            if decision is not None:
                no_down = obs.time + self.config.interval
                if decision.delta > 0:
                    no_down = max(no_down, obs.time + self.config.down_after_up)
                self._no_down_until[role] = no_down
                self._last_change[role] = obs.time
                self._planned[role] = _demand(load if decision.delta > 0 else wider)
                self._since.pop((role, "up"), None)
                self._since.pop((role, "down"), None)
                decisions.append(decision)
        return decisions

    def _as_deployed(self, load: Load, size: Size, current: Mapping[str, int]) -> Size:
        """The deployment as it is when it has as many nodes as `size` and meets the SLO
        too: splits of one total tie, and the one the search found first flipped with
        the load (a simulated conditional deployment went 1P+2D -> 0P+3D -> 2P+1D within
        two minutes, each move a node started or drained)."""
        p, d = current.get("prefill"), current.get("decode")
        if p is None or d is None or not size.feasible or load.rate <= 0:
            return size
        if p + d != size.prefill + size.decode or (p, d) == (size.prefill, size.decode):
            return size
        bp, bd = self.sizer.bounds["prefill"], self.sizer.bounds["decode"]
        if not (bp.min <= p <= bp.max and bd.min <= d <= bd.max):
            return size
        got = self.sizer.attainment(load, p, d)
        return Size(p, d, got, True) if got >= self.sizer.slo.attainment else size

    def _held(self, now: float, current: Mapping[str, int], near: float) -> bool:
        """No role can move this tick, whatever the size: each is pinned by its bounds,
        or changed less than an interval ago minus the down window (a scale-down at the
        interval's end needs its size below the count only since then) and the load
        without the look ahead has not outrun what that change planned for (the only
        scale-up within the interval). Such a tick sizes nothing: with a look ahead the
        forecast is a new load nearly every tick, and sizing each took a simulated hour
        of a 64-node cluster past 75 CPU-minutes. (`load`, `size` and `infeasible` keep
        the last sized tick's meanwhile.)"""
        cfg = self.config
        hold = cfg.interval - cfg.down_window

        def held(role: str) -> bool:
            bounds = self.sizer.bounds[role]
            if bounds.min == bounds.max == current[role]:
                return True  # pinned
            changed = self._last_change.get(role, -math.inf)
            return now - changed < hold and near <= self._planned.get(role, 0.0)

        return hold > 0 and all(held(role) for role in ROLES if role in current)

    def _note_feasible(self, feasible: bool, now: float) -> None:
        """Infeasible at once; feasible again only once every size has been so for
        `down_window` (as long as a scale-down from the maximum waits). At a peak the
        backlog term pushes the planned rate past what the maximum serves and back
        within a tick or two, and the flag flapped: a log line each time."""
        if not feasible:
            self.infeasible, self._feasible_since = True, None
        elif self.infeasible:
            if self._feasible_since is None:
                self._feasible_since = now
            if now - self._feasible_since >= self.config.down_window:
                self.infeasible, self._feasible_since = False, None

    def _drain(self, rate: float, queued: int) -> float:
        """The rate that drains the prefill queue's excess within the horizon, at an
        arrival `rate` (before the interval's look ahead). A deployment that fell behind
        (a ramp faster than nodes start) holds more jobs than the arrival rate at the TTFT
        target explains (rate x target, by Little's law); sized from arrivals alone, it
        stayed behind: every queued request missed its TTFT while the size matched the
        rate (a simulated H100 day met the SLO for 14%)."""
        excess = queued - rate * self.sizer.slo.ttft
        if excess <= 0 or rate <= 0:
            return 0.0
        return excess / max(self.config.horizon, 1.0)

    def _smallest(self) -> Size:
        b = self.sizer.bounds
        return Size(b["prefill"].min, b["decode"].min, 1.0, True)

    def _decide(
        self, role: str, obs: Observation, count: int, size: Size, keep: Size, near: float
    ) -> Decision | None:
        """Toward `size`; down only to what `keep` (the size at a load DOWN_MARGIN higher)
        still allows; within the interval up only when `near` (the demand without the look
        ahead) outruns the last change's plan."""
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
        if want > count:
            # `count` holds the nodes still loading: capacity on its way is not asked
            # for twice, and a size that grew meanwhile (a ramp, a backlog) is not kept
            # waiting for them (it was, and a ramp outran a 64-node cluster by a minute
            # a step)
            self._since.pop((role, "down"), None)
            held = now - self._last_change.get(role, -math.inf) < cfg.interval
            if held and near <= self._planned.get(role, 0.0):
                return None  # the last change planned for this far ahead: not outrun
            started = self._since.setdefault((role, "up"), now)
            if now - started >= cfg.up_window:
                return Decision(role, want - count, why)
            return None
        self._since.pop((role, "up"), None)
        if want < count:
            started = self._since.setdefault((role, "down"), now)
            allowed = now >= self._no_down_until.get(role, -math.inf)
            if now - started >= cfg.down_window and allowed and serving:
                # with an interval, every spare node at once (the size is to hold that
                # long); without, one at a time (the next tick sizes again)
                spare = count - want if cfg.interval > 0 else 1
                victims = choose_victims(serving, spare)
                return Decision(role, -len(victims), why, tuple(v.node_id for v in victims))
            return None
        self._since.pop((role, "down"), None)
        return None


def _lengths(a: _Count, b: _Count) -> tuple[int, int, int, int]:
    """Mean prompt and output tokens of the requests served between two counts, and the
    half-width of a uniform of the same variance (sqrt(3) sigma) for each."""
    done = b.requests - a.requests

    def mean_spread(total: float, squares: float) -> tuple[int, int]:
        mean = total / done
        variance = max(0.0, squares / done - mean * mean)  # (counts taken at different
        return round(mean), round(math.sqrt(3 * variance))  # moments: never below 0)

    prompt = mean_spread(b.prompt_tokens - a.prompt_tokens, b.prompt_sq - a.prompt_sq)
    output = mean_spread(b.output_tokens - a.output_tokens, b.output_sq - a.output_sq)
    return prompt[0], output[0], prompt[1], output[1]


def _demand(load: Load) -> float:
    """Tokens a second the load brings (what outrunning a plan is measured in: a rate
    that holds while prompts grow longer is more load)."""
    return load.rate * (load.prompt_tokens + load.output_tokens)


def _middle(counts: list[_Count]) -> _Count:
    first, last = counts[0], counts[-1]
    return min(counts, key=lambda c: abs(c.time - (first.time + last.time) / 2))


def _trend(counts: list[_Count]) -> float:
    """The arrival rate's slope (req/s a second) between the halves of `counts`, or 0
    where their counts differ within Poisson noise (3 sigma): a steady load's noise,
    extrapolated over the horizon, moved the size up and down. Over a longer span a
    trend stands out sooner (the difference grows with the span squared, the noise with
    its root): on the simulated H100 day's steepest climb, ~0.24 req/s a second at 165
    req/s, the halves of 60 s differ by ~210 arrivals, under 3 sigma (~300); of 300 s,
    by ~5,300 against ~670."""
    first, last = counts[0], counts[-1]
    middle = _middle(counts)
    half = (last.time - first.time) / 2
    n1, n2 = middle.arrivals - first.arrivals, last.arrivals - middle.arrivals
    if half <= 0 or n2 - n1 <= 3 * math.sqrt(max(n1 + n2, 1.0)):
        return 0.0
    return (_rate(middle, last) - _rate(first, middle)) / half


def _rate(a: _Count, b: _Count) -> float:
    return (b.arrivals - a.arrivals) / (b.time - a.time) if b.time > a.time else 0.0


def load_text(load: Load | None) -> str:
    if load is None:
        return "no load yet"
    return (
        f"{load.rate:.3g} req/s of {load.prompt_tokens} prompt + {load.output_tokens} output tokens"
    )
