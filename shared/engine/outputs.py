"""What an engine step produces per request, and the engine's running counts (plain data:
no torch, so a module that only relays outputs does not load the model stack)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.bus.messages import TokenLogprob


@dataclass
class StepOutput:
    """What one step produced for one request."""

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
