"""A sequence's state between the engine and the wire: `SequenceState` (the engine's) to
and from `SequenceSnapshot` (the hand-off message's)."""

from __future__ import annotations

from shared.bus.ids import AttemptId
from shared.bus.messages import SequenceSnapshot
from shared.engine.types import SequenceState


def to_wire(state: SequenceState) -> SequenceSnapshot:
    """The snapshot a hand-off carries (`Engine.export` copied the lists already)."""
    return SequenceSnapshot(
        attempt_id=AttemptId(state.request_id),  # a node's engine names sequences by it
        prompt_ids=state.prompt_ids,
        output_ids=state.output_ids,
        params=state.params,
        num_computed=state.num_computed,
    )


def from_wire(snapshot: SequenceSnapshot) -> SequenceState:
    """The state an engine continues from a received snapshot."""
    return SequenceState(
        request_id=snapshot.attempt_id,
        prompt_ids=snapshot.prompt_ids,
        output_ids=snapshot.output_ids,
        params=snapshot.params,
        num_computed=snapshot.num_computed,
    )
