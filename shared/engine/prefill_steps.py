"""A prefill node's batch, step by step: the jobs it fetched together are prefilled shortest
first, in engine steps of at most `max_num_batched_tokens` prompt tokens (a longer prompt
runs alone), and each step's first tokens and KV frames are handed out as that step ends.

Why steps and not one forward for the batch: a batch's first tokens all came at its end,
so a short prompt fetched with two long ones waited for both, and the first of two long
prompts waited for the second (on one CPU thread a 1,500-token prompt takes seconds).
Why shortest first: a short prompt fetched with a long one is then out a step later, not
the long one's prefill later, and the long one waits at most for the few short ones of
its own batch (simulated, 1P:1D on one core, 20% 500-token prompts at 0.7 req/s: SLO
attainment 83% with FIFO steps, 86% shortest first; docs/benchmarks-log.md).
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Protocol, TypeVar

from shared.engine.types import SequenceState, StepOutput
from shared.errors import CapacityError
from shared.sampling_params import SamplingParams

# a request to prefill: its id, its prompt's token ids, its sampling parameters
PrefillRequest = tuple[str, list[int], SamplingParams]
# a prefilled request: its first token, and its KV to ship (none if that token ended it)
Prefilled = tuple[StepOutput, SequenceState | None, memoryview | None]


class Produced(Protocol):
    """What a step gives back for a request that got its first token."""

    @property
    def request_id(self) -> str: ...

    @property
    def finished(self) -> bool: ...


Out = TypeVar("Out", bound=Produced, covariant=True)
State = TypeVar("State", covariant=True)
Frame = TypeVar("Frame", covariant=True)


class BatchEngine(Protocol[Out, State, Frame]):
    """What a batch's steps need of an engine: a node's (`EngineCore`: step outputs, KV
    snapshots and frames) or the planner's simulated one (tandem/plan/simprefill.py), which
    runs this same rule with nothing to compute or ship."""

    def has_unfinished(self) -> bool: ...

    @property
    def num_waiting(self) -> int: ...

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        output_ids: list[int] | None = None,
    ) -> str: ...

    def step(self) -> Sequence[Out]: ...

    def export(self, request_id: str) -> tuple[State, Frame]: ...

    def abort(self, request_id: str) -> bool: ...

    def cancel_all(self) -> None: ...


R = TypeVar("R", bound=Produced)
S = TypeVar("S")
F = TypeVar("F")


def prefill_steps(
    engine: BatchEngine[R, S, F],
    requests: list[PrefillRequest],
    resumed: dict[str, list[int]] | None = None,
) -> Generator[list[tuple[R, S | None, F | None]], None, None]:
    """Add the requests, shortest (prompt and resumed output) first, then yield each step's
    prefilled ones (their blocks freed once exported). Run every `next` on the engine
    thread. On a node each one is a `Prefilled`.

    `resumed` maps request ids to output tokens generated before a failover. An error, or
    the generator closed early, cancels what is left, so the next batch starts clean.
    """
    if engine.has_unfinished():
        raise RuntimeError("a prefill batch needs an engine with no other work")
    resumed = resumed or {}

    def context(request: PrefillRequest) -> int:
        return len(request[1]) + len(resumed.get(request[0], ()))

    try:
        for request_id, prompt_ids, params in sorted(requests, key=context):
            engine.add_request(prompt_ids, params, request_id, resumed.get(request_id))
        while engine.num_waiting:
            outs = engine.step()
            if not outs:
                raise CapacityError("KV blocks exhausted during prefill")
            results: list[tuple[R, S | None, F | None]] = []
            for out in outs:
                if out.finished:
                    results.append((out, None, None))
                    continue
                snapshot, frame = engine.export(out.request_id)
                engine.abort(out.request_id)
                results.append((out, snapshot, frame))
            yield results
    except BaseException:
        engine.cancel_all()
        raise


def prefill_and_export(
    engine: BatchEngine[StepOutput, SequenceState, memoryview],
    requests: list[PrefillRequest],
    resumed: dict[str, list[int]] | None = None,
) -> list[Prefilled]:
    """Every request prefilled (`prefill_steps`), all results at once (tools and tests)."""
    return [r for step in prefill_steps(engine, requests, resumed) for r in step]
