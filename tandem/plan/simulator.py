"""A discrete-event simulation of a Tandem deployment, deciding as the real one decides.

Time comes from a profile (shared/costs/model.py); every decision is the real code's:
- the router plans each request with `services.router.placement.plan` over a
  `NodeTable` fed by simulated heartbeats (every `heartbeat` seconds per node, staggered,
  counting what was sent since as the router does) and the `PrefixRouter` (with
  conditional disaggregation's chooser, costed by the decode profile, when asked), and
  counts prefill backlogs as the router does (`placement.track_backlog`); a decode node
  asked to prefill a request itself takes or refuses it by the node's rule
  (`local_prefill_refusal`), and a refused one goes the router's usual way
  (`placement.after_local_refusal`);
- each node's engine is the real `Scheduler` (simengine.py), continuous batching and
  chunked prefill included;
- prefill nodes take, prefill and hand off jobs as `services/prefill/` does
  (simprefill.py).

Decode steps that decide nothing (the batch only decodes: nothing waits, nothing
prefills, every block it needs is free) are taken as one run up to the first sequence's
last token (`SimEngine.steady_run`), not one event each. Anything that changes the node
meanwhile (a request arriving, a hand-off, a heartbeat reading its state) first cuts the
run: the steps a stepwise node would have begun by then are applied, and the change joins
at the next step, as it would. `Topology.macro_steps=False` steps one event a step (the
reference the tests hold runs to).

KV copies on an engine thread are charged as the profile measured them (none for a
profile without them): a prefill node's export of each prompt's KV before its batch's
first tokens go out, a decode node's import of a handed-off prompt before its next step
(its running streams wait for it), and, with kvcache nodes, a decode node's checkpoint
copy of every block it fills (per token computed, in each step). Prefix loads are not
simulated: the simulated prompts share no prefix. The kvcache nodes' own work and the
checkpoints' network traffic (off the engine thread) are not modelled.

Output: the `RequestRecord`s `tandem bench serve` would have measured (send, first token,
every later gap as runs of equal gaps, end), so the same metrics code summarises both.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from typing import Any, cast

from services.router.conditional import PrefillPathChooser
from services.router.nodes import NodeTable
from services.router.placement import after_local_refusal, check_pool, track_backlog
from services.router.placement import plan as plan_route
from services.router.routing import PrefixRouter
from shared.bus.ids import RequestId
from shared.bus.kv_events import KVIndex
from shared.bus.messages import NodeInfo
from shared.bus.registry import decode_entry, prefill_entry
from shared.costs.model import CostModel
from shared.engine.scheduler import StepPlan
from shared.engine.sequence import Sequence, SequenceStatus
from shared.errors import CapacityError
from shared.runtime.collector import collector_paused
from tandem.bench.metrics import RequestRecord, add_gap
from tandem.plan.simengine import SimEngine, SteadyRun
from tandem.plan.simnodes import DecodeNode, Job, PrefillNode, simulated_prompt
from tandem.plan.simscale import ScalingSide
from tandem.plan.topology import Arrival, Topology

DEFAULT_TIMEOUT = 300.0  # a request's client gives up after this (bench serve's --timeout)
RUN_LIMIT = 4096  # steady decode steps taken as one run at most
FINISHED = SequenceStatus.FINISHED


class Simulation(ScalingSide):
    def __init__(
        self, topology: Topology, decode_costs: CostModel, prefill_costs: CostModel | None = None
    ) -> None:
        if (problem := topology.check()) is not None:
            raise ValueError(problem)
        self.topology = topology
        self.transfer_costs = prefill_costs or decode_costs
        self.decode_costs = decode_costs
        self.draining: set[str] = set()  # nodes an autoscaler drains (simscale.py)
        self.starting: dict[str, str] = {}
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._order = itertools.count()
        self.events = 0  # handled so far (what the simulation's time goes with)
        colocated = topology.colocated > 0
        count = topology.colocated or topology.decode
        checkpointing = topology.kvcache > 0
        self.decoders = {
            f"decode-{i}": DecodeNode(
                f"decode-{i}", SimEngine(topology.decode_engine, decode_costs, checkpointing)
            )
            for i in range(count)
        }
        self.prefillers = {
            f"prefill-{i}": PrefillNode(
                f"prefill-{i}", SimEngine(topology.prefill_engine, self.transfer_costs)
            )
            for i in range(topology.prefill)
        }
        self.numbered = {"decode": count, "prefill": topology.prefill}
        self.queue: deque[Job] = deque()
        # The router's own parts: a node table the heartbeats below fill in, no registry.
        self.nodes = NodeTable(
            cast(Any, None), colocated=colocated, prefill_optional=topology.conditional
        )
        chooser = None
        if topology.conditional and not colocated:
            shape = topology.decode_engine
            chooser = PrefillPathChooser(
                decode_costs,
                topology.local_max_tokens,
                step_budget=shape.step_token_budget,
                chunk_tokens=shape.prefill_chunk_tokens,
                prefill_costs=self.transfer_costs,
                tpot_target=topology.tpot_target,
                clock=lambda: self.now,
            )
        self.routing = PrefixRouter(
            self.nodes, KVIndex(), topology.local_max_tokens, colocated=colocated, chooser=chooser
        )
        every = [*self.decoders, *self.prefillers]
        for i, node_id in enumerate(every):  # staggered, as independent nodes are
            self._set_info(node_id)
            self.at(topology.heartbeat * (i + 1) / len(every), self._heartbeat, node_id)
        self.records: list[RequestRecord] = []
        self._pending: deque[Arrival] = deque()
        # Requests sent, in send order, as (when the router plans them, sent, the request):
        # a queue of their own beside the event heap (their times only grow), so a million
        # arrivals do not make every other event's heap operations slower.
        self._sent: deque[tuple[float, float, Arrival]] = deque()
        self._in_flight = 0
        # Records in send order with their give-up time; one event at a time stands for
        # the earliest (a timeout event per request would double the queue's size).
        self._deadlines: deque[tuple[float, RequestRecord]] = deque()
        self._expiry_due = False
        self._concurrency: int | None = None
        self._timeout = DEFAULT_TIMEOUT
        # id() of the record of each request not yet ended -> its request id ("" until the
        # router has planned it): its end drops its prefill backlog, as relay.release does
        self._open: dict[int, str] = {}
        self._last_token: dict[int, float] = {}  # id() of an open record -> its last token
        self._request_ids = itertools.count()  # distinct across nodes, as attempt ids are
        caching = topology.decode_engine.enable_prefix_caching or (
            topology.prefill > 0 and topology.prefill_engine.enable_prefix_caching
        )
        self._shared_prompts: dict[int, list[int]] | None = None if caching else {}

    # ---- the event loop ---------------------------------------------------------------------

    def at(self, when: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._events, (when, next(self._order), fn, args))

    def run(
        self,
        arrivals: list[Arrival],
        concurrency: int | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> list[RequestRecord]:
        """Simulate until every request has ended (finished, failed, or past `timeout`
        seconds after it was sent, as the client gives up); their records, in send order."""
        self._concurrency, self._timeout = concurrency, timeout
        self._pending = deque(sorted(arrivals, key=lambda a: a.at))
        self._release_arrivals()
        # The records, sequences and events a long run makes hold no reference cycles: the
        # cyclic collector would only walk them, ever longer (a quarter of the time of a
        # run of 180,000 requests, measured), and free nothing.
        with collector_paused():
            self._loop()
        return self.records

    def _loop(self) -> None:
        events, sent = self._events, self._sent
        while (events or sent) and (self._in_flight or self._pending):
            self.events += 1
            if sent and (not events or sent[0][0] <= events[0][0]):
                self.now, when, arrival = sent.popleft()
                self._admit(arrival, when)
                continue
            when, _, fn, args = heapq.heappop(events)
            self.now = when
            fn(*args)

    def _release_arrivals(self) -> None:
        """Send the next requests the concurrency cap allows (open loop: all of them)."""
        latency = self.topology.admission_latency
        while self._pending and (self._concurrency is None or self._in_flight < self._concurrency):
            arrival = self._pending.popleft()
            self._in_flight += 1
            sent = max(arrival.at, self.now)
            self._sent.append((sent + latency, sent, arrival))

    # ---- the router ---------------------------------------------------------------------------

    def _heartbeat(self, node_id: str) -> None:
        if node_id not in self.decoders and node_id not in self.prefillers:
            return  # drained away: its entry expired
        self._set_info(node_id)
        self.at(self.now + self.topology.heartbeat, self._heartbeat, node_id)

    def _set_info(self, node_id: str) -> None:
        self.nodes.heard(self._info(node_id), self.now)

    def _info(self, node_id: str) -> NodeInfo:
        """Its registry entry, built as the decode and prefill workers build theirs."""
        draining = node_id in self.draining
        if node_id in self.decoders:
            self._cut(self.decoders[node_id])
            sched = self.decoders[node_id].engine.scheduler
            return decode_entry(
                node_id, running=sched.num_running, waiting=len(sched.waiting),
                free_blocks=sched.pool.num_free, total_blocks=sched.pool.num_blocks,
                now=self.now, hash_key="sim", block_size=sched.config.block_size,
                draining=draining,
            )  # fmt: skip
        node = self.prefillers[node_id]
        sched = node.engine.scheduler
        return prefill_entry(
            node_id, batch=node.batch, free_blocks=sched.pool.num_free,
            total_blocks=sched.pool.num_blocks, now=self.now, hash_key="sim",
            block_size=sched.config.block_size, draining=draining,
        )  # fmt: skip

    def _admit(self, arrival: Arrival, sent: float) -> None:
        """The request was sent at `sent`; the router has it now and plans it (after the
        HTTP, journal and NATS hops: the admission latency)."""
        record = RequestRecord(arrival.prompt_tokens, arrival.max_tokens, sent=sent)
        self.records.append(record)
        self._open[id(record)] = ""
        self._deadlines.append((sent + self._timeout, record))
        if not self._expiry_due:  # (a timeout shorter than the admission latency: now)
            self._expiry_due = True
            self.at(max(self.now, sent + self._timeout), self._expire)
        n = next(self._request_ids)
        prompt = simulated_prompt(n, arrival.prompt_tokens, self._shared_prompts)
        try:
            where = plan_route(self.nodes, self.routing, prompt, arrival.max_tokens)
        except CapacityError as exc:
            self._fail(record, str(exc))
            return
        decoder = self.decoders[where.decode_node.node_id]
        seq = SimEngine.new_sequence(f"r{n}", prompt, arrival.max_tokens)
        self._open[id(record)] = seq.request_id
        local = where.local and self._takes_local(decoder, len(prompt))
        if where.local and not local:  # refused: the usual way, as the router sends it
            try:
                check_pool(self.nodes, where.model)
            except CapacityError as exc:
                self._fail(record, exc.message)
                return
            to = after_local_refusal(self.nodes, where.decode_node, where.blocks, where.model)
            decoder = self.decoders[to.node_id]
        route = "local" if local else "remote"
        track_backlog(self.nodes, cast(RequestId, seq.request_id), where, route, len(prompt))
        if local:
            decoder.records[seq.request_id] = record
            self._cut(decoder)
            decoder.engine.add(seq)
            self._kick(decoder)
            return
        self.queue.append(Job(seq, record, decoder.node_id))
        for node in list(self.prefillers.values()):  # (one may leave: simscale.py)
            if not self.queue:
                break  # taken: the other nodes have nothing to look at
            self._take_jobs(node)

    def _takes_local(self, decoder: DecodeNode, prompt_tokens: int) -> bool:
        self._cut(decoder)  # its pool as of now
        return decoder.engine.takes_local(prompt_tokens, decoder.node_id in self.draining)

    def _token(self, record: RequestRecord, seq: Sequence) -> None:
        """One token of `seq` reaches the client (its first: no longer queued for a
        prefill; its last: the stream ends)."""
        key = id(record)
        rid = self._open.get(key)
        if rid is None:
            return  # the client gave up on it
        if not record.chunks:
            self.nodes.prefill_done(rid)
            record.chunks.append(self.now)
            record.itl_runs = []
        else:
            add_gap(record, self.now - self._last_token[key])
        self._last_token[key] = self.now
        if seq.status is FINISHED:
            self._done(record, seq)

    def _done(self, record: RequestRecord, seq: Sequence) -> None:
        """Its last token has come: the stream ends (every token it made reached the
        client once: a preempted sequence keeps its tokens and sends none again)."""
        record.done = self.now
        record.output_tokens = len(seq.output_ids)
        self._ended(record)

    def _fail(self, record: RequestRecord, error: str) -> None:
        if id(record) in self._open:
            record.error, record.done = error, self.now
            self._ended(record)

    def _expire(self) -> None:
        """The earliest requests' clients give up (those still open)."""
        while self._deadlines and self._deadlines[0][0] <= self.now:
            self._fail(self._deadlines.popleft()[1], f"no answer within {self._timeout:g}s")
        self._expiry_due = bool(self._deadlines)
        if self._deadlines:
            self.at(self._deadlines[0][0], self._expire)

    def _ended(self, record: RequestRecord) -> None:
        self.nodes.prefill_done(self._open.pop(id(record)))  # ended before a first token
        self._last_token.pop(id(record), None)
        self._in_flight -= 1
        self._release_arrivals()

    # ---- decode nodes -------------------------------------------------------------------------

    def _kick(self, node: DecodeNode) -> None:
        if node.stepping:
            return
        if not node.engine.scheduler.has_unfinished():
            if node.node_id in self.draining:
                self.retire_if_idle(node.node_id)
            return
        stall, node.stall = node.stall, 0.0
        if self.topology.macro_steps and (run := node.engine.steady_run(RUN_LIMIT)) is not None:
            batch, total, steps = run
            if stall:  # the imports run before the first step: it takes that much longer
                (first, count), rest = steps[0], steps[1:]
                steps = [(first + stall, 1), *([(first, count - 1)] if count > 1 else []), *rest]
            node.run = SteadyRun(self.now, batch, steps, total)
            node.stepping = True
            node.generation += 1
            self.at(self.now + node.run.elapsed(total), self._run_end, node, node.generation)
            return
        plan, seconds, decoded = node.engine.begin()
        if not plan.decodes and not plan.prefills:
            node.stall = stall  # nothing to wait for it yet
            return  # nothing fits now; the next arrival or hand-off kicks again
        node.stepping = True
        node.step_end = self.now + seconds + stall
        self.at(node.step_end, self._step_done, node, plan, decoded)

    def _cut(self, node: DecodeNode) -> None:
        """Before the node changes mid-run: apply the steps a stepwise node has begun by
        now, and end the run with the one in progress (the change joins the next step)."""
        run = node.run
        if run is None:
            return
        begun = run.begun(self.now)
        self._apply(node, run, begun)
        if begun < run.total:
            run.total = begun
            node.generation += 1
            self.at(run.start + run.elapsed(begun), self._run_end, node, node.generation)

    def _apply(self, node: DecodeNode, run: SteadyRun, upto: int) -> None:
        """Steps run.applied+1 .. `upto` into the engine and the records (their tokens'
        times are known; they reach the client at those times, after this)."""
        if upto <= run.applied:
            return
        node.engine.advance(run.batch, upto - run.applied)
        # A stream whose last token ended the step before (or the run before) waits the
        # step's own time for its next: that value, not a difference of clock readings,
        # so that its gaps stay one run of equal gaps (20 runs a record of a simulated
        # hour at 300 req/s instead of 27; the metrics read them that much faster)
        previous_end = run.start + run.elapsed(run.applied)
        first_end = run.start + run.elapsed(run.applied + 1)
        last_end = run.start + run.elapsed(upto)
        ((first_step, _),) = run.gaps(run.applied, run.applied + 1)
        rest = run.gaps(run.applied + 1, upto)
        for seq in run.batch:
            record = node.records[seq.request_id]
            key = id(record)
            if key not in self._open:
                continue  # the client gave up on it
            last = self._last_token[key]
            add_gap(record, first_step if last == previous_end else first_end - last)
            for each, count in rest:
                add_gap(record, each, count)
            self._last_token[key] = last_end
        run.applied = upto

    def _run_end(self, node: DecodeNode, generation: int) -> None:
        if generation != node.generation or node.run is None:
            return  # cut meanwhile: its end is the cut's
        run, node.run = node.run, None
        self._apply(node, run, run.total)
        node.stepping = False
        for seq in run.batch:
            if seq.status is SequenceStatus.FINISHED:
                record = node.records.pop(seq.request_id)
                if id(record) in self._open:
                    self._done(record, seq)
        self._kick(node)

    def _step_done(self, node: DecodeNode, plan: StepPlan, decoded: list[Sequence]) -> None:
        node.stepping = False
        for seq in decoded + node.engine.end(plan):
            last = seq.status is FINISHED
            record = node.records.pop(seq.request_id) if last else node.records[seq.request_id]
            self._token(record, seq)
        self._kick(node)
