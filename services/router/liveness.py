"""Fast failure detection: probe a node whose stream went quiet, instead of waiting for its
registry entry to expire.

Heartbeat expiry takes the registry TTL (seconds); a decode step takes ~0.1 s. So the
router pings every node that should send the next token of some in-flight stream
(`tandem.node.<id>.ping`, answered by every node's event loop, which stays free while its
engine computes): every `every` seconds (0.05), and every `interval` (0.025) once a stream
has had no token for 3x its usual gap between tokens (at least 0.15 s, at most
`probe_after`). A SIGKILLed node's subscription is gone with its connection (its sockets
close once the kernel has freed its memory, tens of ms after the kill), and NATS answers
the next probe "no responders" at once: the node is declared dead and its requests fail
over right away, half a probe period after its connection closed on average, rather than
after three token gaps. A node cut off without closing its connection (a pulled cable)
answers nothing: after `misses` timed-out probes in a row while its streams are quiet it is
declared dead too (a probe lost while tokens still flow counts for nothing: a busy node is
not a dead one). A node that answers is alive however slow its stream: the stall timeout
still bounds that. A node answering "stalled: ..." says its streams should move (a decode
node whose engine call has run past its `--engine-stall-timeout`: its event loop answers,
its engine does not); it is declared dead at once.

Probes of one node overlap (up to `max_in_flight`): a probe sent a moment before the node
died is never answered, and waiting out its timeout before the next one went out made
death take 0.25 s more to notice. Overlapping probes do not make a silent node die
sooner: timed-out probes sent within one `timeout` of each other count as one miss.

While the router's own NATS connection is down, and for `reconnect_grace` after it comes
back, probes give no verdict: after a NATS restart every node reconnects on its own
schedule, and one that comes back a moment after the router has no subscription yet, so
NATS answers "no responders" for a node that is alive (this once failed every stream of a
NATS restart over to nodes that were all "dead").

A probe whose timeout the router itself noticed late (its event loop held up for more than
half a timeout: a starved or overloaded router process) gives no verdict either: the answer
may be sitting unread in the router's socket, and its streams look quiet because their
tokens are unread too. Under heavy CPU load this once moved streams off live nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from services.router.inflight import InFlight
from services.router.metrics import RouterMetrics
from services.router.nodes import NodeTable
from shared.bus.client import Bus
from shared.bus.topology import PING_STALLED, ping_subject

log = logging.getLogger("tandem.router.liveness")


@dataclass(frozen=True)
class ProbeTiming:
    """When and how often nodes are probed (see the module docstring)."""

    probe_after: float = 0.5
    timeout: float = 0.25
    misses: int = 3
    interval: float = 0.025
    floor: float = 0.15
    every: float = 0.05
    reconnect_grace: float = 2.0
    max_in_flight: int = 3


class LivenessProbe:
    def __init__(
        self,
        bus: Bus,
        inflight: InFlight,
        nodes: NodeTable,
        metrics: RouterMetrics,
        on_dead: Callable[[str], None],
        timing: ProbeTiming | None = None,
    ) -> None:
        self.bus = bus
        self.inflight = inflight
        self.nodes = nodes
        self.metrics = metrics
        self.on_dead = on_dead  # the node's requests fail over
        self.timing = timing or ProbeTiming()
        self.last_probe: dict[str, float] = {}
        self.missed: dict[str, int] = {}  # node → probes unanswered in a row
        self.miss_sent: dict[str, float] = {}  # node → when the last counted miss was sent
        self.in_flight: dict[str, int] = {}  # node → probes awaiting an answer
        self.dead: dict[str, float] = {}  # node → when declared dead (not probed again soon)
        self._tasks: set[asyncio.Task[None]] = set()

    def serving_nodes(self) -> set[str]:
        """Nodes that should send the next token of some in-flight stream."""
        return {n for f in list(self.inflight.failovers.values()) if (n := f.expected_sender())}

    def quiet_nodes(self, now: float) -> set[str]:
        """Nodes some in-flight stream has waited on for longer than it should: 3x its
        usual gap between tokens (at least `floor`), at most `probe_after`."""
        out = set()
        for failover in list(self.inflight.failovers.values()):
            node = failover.expected_sender()
            itl = failover.stream.itl
            after = self.timing.probe_after if itl is None else max(self.timing.floor, 3 * itl)
            if node and now - failover.stream.last_delta_at > min(after, self.timing.probe_after):
                out.add(node)
        return out

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            now = time.monotonic()
            quiet = self.quiet_nodes(now)
            for node in self.serving_nodes():
                if now - self.dead.get(node, -1e9) < 5.0:
                    continue  # just declared dead: its requests are moving already
                if self.in_flight.get(node, 0) >= self.timing.max_in_flight:
                    continue
                every = self.timing.interval if node in quiet else self.timing.every
                if now - self.last_probe.get(node, -1e9) < every:
                    continue
                self.last_probe[node] = now
                self.in_flight[node] = self.in_flight.get(node, 0) + 1
                task = asyncio.create_task(self._probe(node, now))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.timing.interval)
        for task in list(self._tasks):
            task.cancel()

    async def _probe(self, node: str, sent: float) -> None:
        try:
            assert self.bus.nc is not None
            info = self.nodes.nodes.get(node)
            if info is None:  # not registered (any more): its leaving moves its streams
                return
            subject = ping_subject(info.role, node)  # only that role's identity answers
            reply = await self.bus.nc.request(subject, b"", timeout=self.timing.timeout)
            if reply.data.startswith(PING_STALLED.encode()):  # alive, its engine hung
                self._declare_dead(node, reply.data[:200].decode(errors="replace"))
                return
            self._forget_misses(node)
        except (NoRespondersError, NatsTimeout, TimeoutError) as exc:
            if isinstance(exc, NoRespondersError) or not self._held_up(sent):
                self._unanswered(node, isinstance(exc, NoRespondersError), sent)
            else:
                log.debug("probe of %s timed out while this router was held up", node)
        except Exception as exc:  # NATS itself away: no verdict on the node
            log.debug("probe of %s failed: %r", node, exc)
        finally:
            self.in_flight[node] -= 1
            if not self.in_flight[node]:
                del self.in_flight[node]

    def _held_up(self, sent: float) -> bool:
        """Whether the router noticed a probe sent at `sent` time out late: its own loop
        was held up, so the silence may be its own (see the module docstring)."""
        late = time.monotonic() - sent - self.timing.timeout
        return late > self.timing.timeout / 2

    def _forget_misses(self, node: str) -> None:
        self.missed.pop(node, None)
        self.miss_sent.pop(node, None)

    def _unanswered(self, node: str, no_responders: bool, sent: float) -> None:
        if self._reconnecting():
            self._forget_misses(node)
        elif no_responders:
            self._declare_dead(node, "no responders")
        elif node not in self.quiet_nodes(time.monotonic()):
            self._forget_misses(node)  # its tokens still flow: slow, not dead
        elif sent - self.miss_sent.get(node, -1e9) >= self.timing.timeout:  # a new silence
            self.miss_sent[node] = sent
            self.missed[node] = self.missed.get(node, 0) + 1
            if self.missed[node] >= self.timing.misses:
                self._declare_dead(node, f"{self.timing.misses} probes unanswered")

    def _reconnecting(self) -> bool:
        """The router's NATS connection is down or just came back: no verdict on nodes."""
        bus = self.bus
        since = time.monotonic() - bus.reconnected_at
        return not bus.is_connected or since < self.timing.reconnect_grace

    def _declare_dead(self, node: str, why: str) -> None:
        if time.monotonic() - self.dead.get(node, -1e9) < 5.0:
            return  # an overlapping probe said so already
        self._forget_misses(node)  # a node that returns starts afresh
        self.dead[node] = time.monotonic()
        log.warning("node %s declared dead (%s): failing its requests over", node, why)
        self.metrics.errors.labels("node_unresponsive").inc()
        self.nodes.suspect(node)
        self.on_dead(node)
