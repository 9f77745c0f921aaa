"""Token deltas from engine outputs: the one place a StepOutput becomes a wire message."""

from __future__ import annotations

from shared.bus.ids import AttemptId
from shared.bus.messages import TokenDelta, TokenLogprob
from shared.engine import types


def wire_logprobs(lps: list[types.TokenLogprob] | None) -> list[TokenLogprob] | None:
    """The engine's logprobs as the wire carries them."""
    if lps is None:
        return None
    return [TokenLogprob(lp.logprob, lp.top_ids, lp.top_logprobs) for lp in lps]


def delta_from_output(out: types.StepOutput, node_id: str, handoff: int) -> TokenDelta:
    """`seq` is the index of the delta's last token (it may bring several), so any node
    numbers alike; `handoff` is the request's handoff this node runs (the router fences
    by it)."""
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
        logprobs=wire_logprobs(out.logprobs),
        prompt_logprobs=wire_logprobs(out.prompt_logprobs),
        text_ends=out.text_ends if len(out.new_token_ids) > 1 else None,
    )
