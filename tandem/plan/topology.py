"""What a simulation (simulator.py) runs: the deployment, with its nodes' engine options,
and the requests, with their send times."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.runtime.options import PREFILL_MAX_BATCH
from tandem.plan.simengine import EngineShape


@dataclass(frozen=True)
class Topology:
    """What is deployed. `colocated` > 0: that many decode nodes prefilling everything
    themselves (`tandem router --colocated`); else `prefill` + `decode` nodes."""

    colocated: int = 0
    prefill: int = 0
    decode: int = 0
    decode_engine: EngineShape = field(default_factory=lambda: EngineShape(num_blocks=4096))
    prefill_engine: EngineShape = field(default_factory=lambda: EngineShape(num_blocks=4096))
    prefill_max_batch: int = PREFILL_MAX_BATCH  # `tandem prefill --max-batch`
    local_max_tokens: int = 96  # `tandem router --local-prefill-max-tokens`
    heartbeat: float = 2.0  # the nodes' registry period (heartbeat TTL / 3)
    conditional: bool = False  # `tandem router --conditional`, with the decode profile's costs
    tpot_target: float = 0.0  # `tandem router --tpot-target` (0: none)
    # From a request's send to its planning by the router and on to a node: HTTP, journal
    # write, NATS. Software, not hardware: measured 40-60 ms on the 2-core machine by
    # `tandem plan validate` (the first token's gap to the profile; docs/benchmarks-log.md),
    # the commands' default (--admission-latency 0.05); none unless given here.
    admission_latency: float = 0.0
    macro_steps: bool = True  # steady decode steps as one run (False: an event a step)
    # kvcache nodes: with any, decode nodes checkpoint (copy every block they fill out of
    # the pool for the kvcache service, on the engine thread: the profile's checkpoint cost)
    kvcache: int = 0

    def check(self) -> str | None:
        if min(self.colocated, self.prefill, self.decode, self.kvcache) < 0:
            return "node counts cannot be negative"
        if self.colocated and (self.prefill or self.decode):
            return "either colocated nodes or prefill and decode nodes, not both"
        if not self.colocated and self.decode < 1:
            return "a split deployment needs at least one decode node"
        if not self.colocated and self.prefill < 1 and not self.conditional:
            # conditional's chooser sends every prompt to its decode node while no prefill
            # node is up (`tandem up --conditional --autoscale --prefill-min 0` at night)
            return "a split deployment needs a prefill node (or --conditional)"
        return None


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds from the start
    prompt_tokens: int
    max_tokens: int
