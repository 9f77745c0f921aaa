"""The engine's own types: what it takes in (`SequenceState`, with `SamplingParams`) and
gives out per step (`StepOutput`, `TokenLogprob`), and its running counts.

They belong to the engine, not to the wire: the planes (shared/connector/)
map them to and from the control messages of shared/bus/messages.py, so a change to either
side is made in one place and the other side does not import it. Plain data, no torch: a
module that only relays outputs does not load the model stack.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.kv.block_hash import BlockHash
from shared.sampling_params import SamplingParams


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability under the model (before penalties and temperature),
    and the most likely tokens' at its position (`SamplingParams.logprobs`)."""

    logprob: float
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class SequenceState:
    """What an engine needs to continue a sequence another engine started, beside the KV
    of its first `num_computed` tokens (`Engine.export` / `Engine.add_snapshot`)."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    params: SamplingParams  # its seed fixed
    num_computed: int


@dataclass(frozen=True)
class CheckpointPoint:
    """How far a sequence's KV is handed to the uploader: enough to resume it elsewhere."""

    request_id: str
    num_tokens: int  # positions covered by its handed-over full blocks
    block_hashes: list[BlockHash]
    output_ids: list[int]  # generated so far (with params' seed: the sampler's whole state)


@dataclass
class StepOutput:
    """What one step produced for one request. `new_token_ids` may hold several tokens
    (an engine that speculates or decodes ahead); `logprobs`, if asked, has one per token."""

    request_id: str
    new_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens that came from the prefix cache
    logprobs: list[TokenLogprob] | None = None  # one per new token, if the request asks
    # with the first token, if asked: prompt tokens 1.. (the first has none)
    prompt_logprobs: list[TokenLogprob] | None = None
    # With several tokens: the length `text` had after each (what a client served token by
    # token would have had), so a reader can cut the output between two of them. None: one
    # token, or an engine that cannot say.
    text_ends: list[int] | None = None


@dataclass
class EngineStats:
    steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    cached_prompt_tokens: int = 0
    chunked_steps: int = 0  # steps that computed prompt chunks beside running decodes
    last_batch_size: int = 0
