"""The simulator's nodes (simulator.py): each one's engine (simengine.py) and what the
simulation keeps beside it between events."""

from __future__ import annotations

from dataclasses import dataclass

from shared.engine.sequence import Sequence
from tandem.bench.metrics import RequestRecord
from tandem.plan.simengine import SimEngine, SteadyRun


@dataclass
class Job:
    """A request queued for the prefill pool, with the decode node the router chose."""

    seq: Sequence
    record: RequestRecord
    decode_node: str


class DecodeNode:
    def __init__(self, node_id: str, engine: SimEngine) -> None:
        self.node_id = node_id
        self.engine = engine
        self.stepping = False
        self.records: dict[str, RequestRecord] = {}
        self.run: SteadyRun | None = None
        self.generation = 0  # of the run whose end is scheduled (a cut one's is stale)
        self.stall = 0.0  # KV imports waiting to run on its engine thread before the next step
        self.step_end = 0.0  # when its step in progress ends (stepping one event a step)

    def free_at(self) -> float:
        """When its engine thread is next free between steps (the step in progress ends;
        after a cut, a run's last step is the one in progress)."""
        if self.run is not None:
            return self.run.start + self.run.elapsed(self.run.total)
        return self.step_end if self.stepping else 0.0


class PrefillNode:
    def __init__(self, node_id: str, engine: SimEngine) -> None:
        self.node_id = node_id
        self.engine = engine
        self.holding = 0  # jobs taken and not yet handed off
        # the batch's size until its last hand-off: what the node reports as its load and
        # queue depth (services/prefill/worker.py `queue_depth`)
        self.batch = 0


def simulated_prompt(n: int, tokens: int, shared: dict[int, list[int]] | None) -> list[int]:
    """Request `n`'s prompt of `tokens` tokens: distinct first tokens, so that no two
    simulated prompts share a prefix, as in the bench. Without prefix caching (`shared`
    given) nothing reads a token's value, only their count: then one list serves every
    prompt of a length (building and freeing a list of ~1,000 tokens a request was a tenth
    of a simulated hour's time). Nothing changes a prompt's list."""
    if shared is None:
        return [n + 1000] + [11] * (tokens - 1)
    prompt = shared.get(tokens)
    if prompt is None:
        prompt = shared[tokens] = [1000] + [11] * (tokens - 1)
    return prompt
