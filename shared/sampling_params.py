"""Sampling parameters: what a request asks of generation. A value type of its own, as
vLLM's `SamplingParams` is: the router builds and validates it, control messages carry it,
the engine reads it, and none of the three imports another to share it. Torch-free, so a
process that only routes never loads the model stack to read or write it.

The sampler that applies them is `shared/engine/sampling.py`.
"""

from __future__ import annotations

import math
import secrets

import msgspec

from shared.errors import InvalidRequestError

MASK64 = (1 << 64) - 1  # seeds are unsigned 64-bit


MAX_CACHE_SALT = 512  # with the router's key digest prefixed (65 characters)
MAX_LOGPROBS = 20  # as vLLM's default max_logprobs and OpenAI's top_logprobs
MAX_TEMPERATURE = 2.0  # OpenAI's range
# Seeds the router takes or makes (`new_seed`): 63 bits, so every language's signed 64-bit
# integer holds one; the sampler mixes them into 64-bit keys (MASK64).
SEED_LIMIT = 1 << 63


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Per-request generation settings (travel with the request between nodes)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) means no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # Logits processing (shared/engine/logits.py); a resumed sequence recomputes what these
    # depend on from its prompt and output, so they survive a failover unchanged.
    presence_penalty: float = 0.0  # OpenAI's: minus this for every token already generated
    frequency_penalty: float = 0.0  # minus this times how often it was generated
    repetition_penalty: float = 1.0  # transformers': scores of prompt and output tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    min_tokens: int = 0  # no EOS or stop token before this many tokens
    stop_token_ids: tuple[int, ...] = ()  # generating one of these ends the request
    # Keys the request's KV block hashes (shared/kv/block_hash.py chain_root): only requests
    # with the same salt share cached prefixes. The router may prefix it with a digest of
    # the API key (--cache-isolation key).
    cache_salt: str = ""
    # Log-probabilities to return with each generated token (shared/engine/logprobs.py):
    # None, none; k >= 0, the sampled token's and the k most likely tokens'.
    logprobs: int | None = None
    # The same for every prompt token after the first (completions' `echo`): computed at
    # prefill, delivered with the first token. Such a prompt is prefilled whole, no cache.
    prompt_logprobs: int | None = None
    # An llguidance grammar the output must follow (response_format; shared/engine/guided.py)
    guide: str = ""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def processes_logits(self) -> bool:
        """Whether logits need more than temperature, top-k and top-p (the slow path)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )

    def validate(self, request_id: str | None = None) -> None:
        """Raise InvalidRequestError naming the bad parameter."""

        def bad(param: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(why, request_id=request_id, param=param)

        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise bad("max_tokens", f"max_tokens must be a positive integer, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise bad(
                "temperature",
                f"temperature must be between 0 and {MAX_TEMPERATURE:g}, got {self.temperature}",
            )
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise bad("top_k", f"top_k must be -1, 0 or positive, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < SEED_LIMIT:
            raise bad("seed", "seed must be a non-negative 63-bit integer")
        if any(not s for s in self.stop):
            raise bad("stop", "stop strings must not be empty")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value) or not -2 <= value <= 2:
                raise bad(name, f"{name} must be between -2 and 2, got {value}")
        rp = self.repetition_penalty
        if not math.isfinite(rp) or not 0 < rp <= 10:
            raise bad("repetition_penalty", f"repetition_penalty must be in (0, 10], got {rp}")
        if any(not math.isfinite(b) or not -100 <= b <= 100 for _, b in self.logit_bias):
            raise bad("logit_bias", "logit_bias values must be between -100 and 100")
        if any(t < 0 for t, _ in self.logit_bias) or any(t < 0 for t in self.stop_token_ids):
            raise bad("logit_bias", "token ids must not be negative")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", "min_tokens must be between 0 and max_tokens")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise bad(name, f"{name} must be between 0 and {MAX_LOGPROBS}")
        if len(self.cache_salt) > MAX_CACHE_SALT:
            raise bad("cache_salt", f"cache_salt must be at most {MAX_CACHE_SALT} characters")


def seeded(params: SamplingParams) -> SamplingParams:
    """`params` with its seed fixed: its own, or a new one. The router fixes it once, as it
    admits a request, and every attempt carries it in `params` (retries, failovers, either
    path, a resume by another router); an engine used directly fixes it as it adds one."""
    if params.seed is not None:
        return params
    return msgspec.structs.replace(params, seed=new_seed())


def new_seed() -> int:
    """A seed for a request that gave none: fixed once, so its resumption stays reproducible."""
    return secrets.randbelow(SEED_LIMIT)
