"""What an engine accepts: a request's limits, checked before anything is touched."""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass

from shared.errors import CapacityError, InvalidRequestError
from shared.grammar import check as check_guide
from shared.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    max_model_len: int
    vocab_size: int
    block_size: int
    total_blocks: int

    def check(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        output_ids: list[int] | None = None,
        known: Container[str] = (),
    ) -> None:
        """Raise InvalidRequestError (or CapacityError) without touching any state.

        `output_ids`: tokens generated before (a resumed or imported sequence).
        """
        params.validate(request_id)
        limit = self.max_model_len
        if not prompt_ids:
            raise InvalidRequestError("prompt is empty", request_id=request_id, param="prompt")
        if len(prompt_ids) >= limit:
            raise InvalidRequestError(
                f"prompt has {len(prompt_ids)} tokens; the model's context is {limit}",
                request_id=request_id,
                param="prompt",
            )
        if len(prompt_ids) + params.max_tokens > limit:
            raise InvalidRequestError(
                f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) "
                f"exceeds the model's context of {limit}",
                request_id=request_id,
                param="max_tokens",
            )
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size:
            raise InvalidRequestError(
                "prompt contains token ids outside the vocabulary",
                request_id=request_id,
                param="prompt",
            )
        check_fits(request_id, len(prompt_ids) + params.max_tokens, self.block_size,
                   self.total_blocks)  # fmt: skip
        if output_ids and len(output_ids) >= params.max_tokens:
            raise InvalidRequestError(
                "the sequence has already produced max_tokens", request_id=request_id
            )
        if output_ids and (min(output_ids) < 0 or max(output_ids) >= self.vocab_size):
            raise InvalidRequestError(
                "generated output contains token ids outside the vocabulary",
                request_id=request_id,
            )
        ids = [t for t, _ in params.logit_bias] + list(params.stop_token_ids)
        if ids and max(ids) >= self.vocab_size:
            raise InvalidRequestError(
                "logit_bias or stop_token_ids name tokens outside the vocabulary",
                request_id=request_id,
                param="logit_bias" if params.logit_bias else "stop_token_ids",
            )
        if params.guide:
            check_guide(params.guide)
        if request_id in known:
            raise InvalidRequestError(f"duplicate request id {request_id!r}", request_id=request_id)


def handoff_refusal(free_blocks: int, blocks: int, waiting: int, running: int) -> str | None:
    """Why a decode node refuses a sequence whose KV (`blocks` of it) was computed
    elsewhere, or None when it takes it. `free_blocks`: free beyond those promised to
    arrivals under way; `waiting`: sequences mid-stream queued on the node for KV room
    (preempted, or resumed: `num_waiting_midstream`; a new prompt queued for its prefill
    is the normal flow of a node that prefills too, and stops nothing); `running`: the
    sequences decoding here.

    Only with a block left for the next token of each running sequence and of this one:
    taken down to its last free block, a node preempted as soon as its streams grew (each
    wants a block every block-size tokens, long before the sequences that finish meanwhile
    free theirs), and every preemption recomputes a prompt here. A simulated H100 cluster
    at 50% free KV still preempted a few sequences a minute per node, and each one's
    recomputation refused every hand-off (below) while prefill nodes waited.

    Not while any wait: they came first, and a sequence admitted past them takes the room
    they wait for. A node short of KV preempts running sequences; it took hand-offs into
    the room each preemption freed, preempted again, and recomputed prompts for minutes
    (a simulated H100 decode node held 1,787 preempted sequences; its cluster met the SLO
    for half the requests at a load it met alone with fixed-length prompts). Refused, a
    prefill node keeps the KV and offers it again, elsewhere or later (its backoff).
    The real node (shared/connector/receiver.py) and the simulated one
    (tandem/plan/simengine.py) both ask this."""
    if waiting > 0:
        return "sequences wait here for KV room"
    if free_blocks < blocks + 1 + running:
        return "not enough free KV blocks"
    return None


def check_fits(request_id: str, tokens: int, block_size: int, total_blocks: int) -> None:
    """CapacityError if a sequence of `tokens` (prompt and max_tokens) needs more blocks
    than the pool has in all (the planner's engines apply it too)."""
    if -(-tokens // block_size) > total_blocks:
        raise CapacityError(
            "request needs more KV blocks than this node has in total", request_id=request_id
        )
