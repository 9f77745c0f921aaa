"""Token deltas from engine outputs: the one place a StepOutput becomes a wire message."""

from __future__ import annotations

from shared.bus.ids import AttemptId
from shared.bus.messages import TokenDelta
from shared.engine.outputs import StepOutput


def delta_from_output(out: StepOutput, node_id: str, handoff: int) -> TokenDelta:
    """`seq` is the index of the token the delta brings, so any node numbers alike;
    `handoff` is the request's handoff this node runs (the router fences by it)."""
    return TokenDelta(
        attempt_id=AttemptId(out.request_id),  # a node's engine names sequences by it
        seq=out.num_output_tokens - 1,
        token_ids=out.new_token_ids,
        text=out.text,
        finished=out.finished,
        finish_reason=out.finish_reason,
        node_id=node_id,
        prompt_tokens=out.num_prompt_tokens,
        completion_tokens=out.num_output_tokens,
        handoff=handoff,
        logprobs=out.logprobs,
        prompt_logprobs=out.prompt_logprobs,
    )
