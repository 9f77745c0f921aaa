"""Conditional disaggregation: per request, prefill on its decode node (local: chunked into
that node's steps, beside its running streams) or on the prefill pool (remote: a prefill
node computes it, then its KV moves to the decode node), whichever gives the request its
first token sooner, from measured costs and the live state.

With a profile (`tandem plan profile`, `--profile`), both paths are estimated in seconds:
- remote: the pool's backlog (prompt tokens sent to it and not yet answered by a first
  token, spread over its nodes) plus this prompt's prefill, plus what must happen before
  the second token: the prefill node's export of its KV, the transfer, and the decode
  node's import (the copies as the profile measured them; none in an older profile);
- local: the decode node's own backlog plus this prompt, prefilled in chunks of
  min(chunk, budget − running) tokens, one chunk per step; each step also runs the node's
  decode batch (running sequences at their mean context, from its block count). An idle
  node prefills the prompt whole in one step, and so does a node without chunking (after
  its current step). The budget and chunk are the decode nodes' options (the router takes
  the same `--step-token-budget` and `--prefill-chunk-tokens`, so one TANDEM_* variable
  sets both).
Local also costs the node's running streams: each waits, over the chunks, for the whole
prefill, so the local side is charged its first token plus running x prefill seconds (the
latency it adds to everyone), the remote side its first token plus running x the import
(the decode node's streams wait for that copy too). A short prompt goes local
when the pool is busy, a long one only when the pool's backlog outweighs what it would cost
the streams (measured: charging only the request's own first token sent long prompts to
busy decode nodes and broke the TPOT target on a long-prompt workload; docs/benchmarks-log.md).
Local wins ties: it moves no KV and leaves the pool to prompts that need it. A prompt
with at most `local_max_tokens` uncached goes local whatever the costs (a few tokens of
prefill barely delay a node's streams; a TPOT target, below, still holds it back), and so
does every prompt when no prefill node is up.

Without a profile, the fallback rule: local when at most `local_max_tokens` are uncached
(as before), or when the pool has more than FALLBACK_POOL_TOKENS queued per prefill node
while the decode node has no local prefill queued; remote otherwise.

With a TPOT target (`tandem router --tpot-target`) and a profile, a local prefill must also
leave the node's running streams within it. A stream decoding in steps of s seconds on a
node that spends a share r of its time on local prefills makes a token every s / (1 - r)
seconds on average, whatever its length; so the prefill seconds the router sent a decode
node over the last TPOT_WINDOW seconds, this prompt's included, may be at most
(1 - s / (TPOT_AIM x target)) of that window, s being the node's step with one stream
more. Past that the prompt goes to the pool (measured on a slow host: the cost objective
alone sent short prompts local while every 100-token prefill stalled the streams ~0.75 s,
and 40% of the requests missed a 250 ms TPOT target at 0.7 req/s; docs/benchmarks-log.md).
The average is aimed a fifth under the target, since streams that live through a long
local prefill see more than the average (measured: aiming at the target itself left 5 of
40 requests just over it, at 263-270 ms for 250). Prompts that go local because no prefill
node is up, or from `PrefixRouter`'s own rule (a cached prefix with at most
`local_max_tokens` uncached), are not held back, nor counted.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from shared.bus.messages import NodeInfo
from shared.costs.model import CostModel
from shared.runtime.options import PREFILL_CHUNK_TOKENS, STEP_TOKEN_BUDGET

FALLBACK_POOL_TOKENS = 2048  # about a long prompt's wait per prefill node: worth going local
# Seconds over which a decode node's local prefills are summed for the TPOT target: about a
# stream's life (a few dozen tokens at a few hundred ms here, a few hundred on a GPU), so
# the stalls a stream sees are those of the window it lives in.
TPOT_WINDOW = 10.0
TPOT_AIM = 0.8  # the share of the TPOT target the node's average is held to (docstring)


@dataclass(frozen=True)
class Choice:
    local: bool
    reason: str  # logged at debug level and set on the request's span


@dataclass(frozen=True)
class Backlog:
    """What is queued ahead of this prompt on each path (NodeTable.backlog_tokens)."""

    pool_tokens: int
    prefill_nodes: int
    local_tokens: int  # queued for a local prefill on the candidate decode node


class PrefillPathChooser:
    def __init__(
        self,
        costs: CostModel | None,
        local_max_tokens: int = 96,
        step_budget: int = STEP_TOKEN_BUDGET,
        chunk_tokens: int = PREFILL_CHUNK_TOKENS,
        prefill_costs: CostModel | None = None,
        tpot_target: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.costs = costs  # the decode nodes' (and, without prefill_costs, the pool's)
        self.prefill_costs = prefill_costs or costs
        self.local_max_tokens = local_max_tokens
        self.step_budget = step_budget
        self.chunk_tokens = chunk_tokens
        self.tpot_target = tpot_target or None  # seconds; none (or 0): no target
        self.clock = clock  # the simulator passes its own
        # per decode node: (when, estimated seconds) of the local prefills sent it lately
        self._sent: dict[str, deque[tuple[float, float]]] = {}

    def choose(
        self,
        local_uncached: int,
        remote_uncached: int,
        prompt: int,
        node: NodeInfo,
        backlog: Backlog,
    ) -> Choice:
        """Prefill locally on `node` (computing `local_uncached` of the `prompt` tokens), or
        remotely (computing `remote_uncached`, the rest loaded from the kvcache service)?"""
        if backlog.prefill_nodes == 0:
            return Choice(True, "no prefill node")
        if local_uncached <= self.local_max_tokens:
            choice = Choice(True, f"{local_uncached} uncached tokens <= {self.local_max_tokens}")
        elif self.costs is None:
            return self._fallback(backlog)
        else:
            local = self.local_seconds(local_uncached, node, backlog.local_tokens)
            stall = node.running * self.costs.prefill(local_uncached)
            remote = self.remote_seconds(remote_uncached, prompt, backlog)
            remote_stall = node.running * self.costs.kv_copy("import", prompt)
            wins = local + stall <= remote + remote_stall
            choice = Choice(
                wins,
                f"local {local:.3f}s + {node.running} streams' stall {stall:.3f}s "
                f"{'<=' if wins else '>'} remote {remote:.3f}s + their stall {remote_stall:.3f}s",
            )
        if choice.local and self.tpot_target is not None and self.costs is not None:
            return self._within_tpot(choice, local_uncached, node)
        return choice

    def _within_tpot(self, choice: Choice, uncached: int, node: NodeInfo) -> Choice:
        """`choice` (local) if the node's streams stay within the TPOT target (see the module
        docstring), then counted against the node; else remote."""
        assert self.costs is not None and self.tpot_target is not None
        now = self.clock()
        sent = self._sent.get(node.node_id)
        while sent and sent[0][0] <= now - TPOT_WINDOW:
            sent.popleft()
        stall = self.costs.prefill(uncached)
        if node.running > 0:
            recent = sum(seconds for _, seconds in sent or ())
            aim = TPOT_AIM * self.tpot_target
            share = max(0.0, 1.0 - self.step_seconds(node, node.running + 1) / aim)
            if recent + stall > share * TPOT_WINDOW:
                return Choice(
                    False,
                    f"tpot: local prefills {recent:.2f}s + {stall:.2f}s in {TPOT_WINDOW:g}s > "
                    f"{share:.0%} of it ({choice.reason})",
                )
        if sent is None:  # a node new here: forget those with nothing recent (nodes come and go)
            self._sent = {n: d for n, d in self._sent.items() if d and d[-1][0] > now - TPOT_WINDOW}
            sent = self._sent[node.node_id] = deque()
        sent.append((now, stall))
        return choice

    def _fallback(self, backlog: Backlog) -> Choice:
        per_node = backlog.pool_tokens / backlog.prefill_nodes
        if per_node > FALLBACK_POOL_TOKENS and backlog.local_tokens == 0:
            return Choice(True, f"pool backlog {per_node:.0f} tokens/node (no profile)")
        return Choice(False, f"pool backlog {per_node:.0f} tokens/node (no profile)")

    def remote_seconds(self, uncached: int, prompt: int, backlog: Backlog) -> float:
        costs = self.prefill_costs
        assert costs is not None
        assert self.costs is not None
        wait = costs.prefill(backlog.pool_tokens) / backlog.prefill_nodes
        copies = costs.kv_copy("export", prompt) + self.costs.kv_copy("import", prompt)
        return wait + costs.prefill(uncached) + copies + costs.kv_transfer(prompt)

    def local_seconds(self, uncached: int, node: NodeInfo, queued: int) -> float:
        assert self.costs is not None
        tokens = queued + uncached
        running = node.running
        if running == 0:
            return self.costs.prefill(tokens)
        step = self.step_seconds(node, running)
        if self.step_budget <= 0:  # no chunking: prefilled whole after the current step
            return step + self.costs.prefill(tokens)
        chunk = max(node.block_size, min(self.chunk_tokens, self.step_budget - running))
        return math.ceil(tokens / chunk) * step + self.costs.prefill(tokens)

    def step_seconds(self, node: NodeInfo, batch: int) -> float:
        """A decode step of `batch` sequences on `node`, at its running ones' mean context
        (from its block count)."""
        assert self.costs is not None
        used = max(0, node.total_kv_blocks - node.free_kv_blocks) * max(1, node.block_size)
        return self.costs.decode(batch, used / max(1, node.running))
