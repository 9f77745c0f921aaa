"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, seeded.

A seeded draw depends only on (seed, absolute position of the token being sampled): the
uniform number comes from a SplitMix64 hash of the two, not from a stateful generator, so a
sequence resumed on another node from exported KV samples exactly the tokens it would have.
"""

from __future__ import annotations

import math
import secrets

import msgspec
import torch

from shared.errors import InvalidRequestError

_MASK64 = (1 << 64) - 1


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Per-request generation settings (travel with the request between nodes)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) means no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self, request_id: str | None = None) -> None:
        """Raise InvalidRequestError naming the bad parameter."""

        def bad(param: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(why, request_id=request_id, param=param)

        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise bad("max_tokens", f"max_tokens must be a positive integer, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", f"temperature must be >= 0, got {self.temperature}")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise bad("top_k", f"top_k must be -1, 0 or positive, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed <= _MASK64:
            raise bad("seed", "seed must be an integer in [0, 2**64)")
        if any(not s for s in self.stop):
            raise bad("stop", "stop strings must not be empty")


def new_seed() -> int:
    """A seed for a request that gave none: fixed once, so its resumption stays reproducible."""
    return secrets.randbits(63)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, position: int) -> float:
    """A uniform draw in [0, 1) that depends only on (seed, position)."""
    return (_splitmix64(_splitmix64(seed) ^ (position & _MASK64)) >> 11) * (1.0 / (1 << 53))


def sample_row(logits: torch.Tensor, params: SamplingParams, seed: int, position: int) -> int:
    """Choose one token from a `[vocab]` float32 logits row."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    scaled = logits.double() / params.temperature
    if params.top_k > 0 and params.top_k < scaled.shape[0]:
        values, indices = torch.topk(scaled, params.top_k)
    else:
        values, indices = torch.sort(scaled, descending=True, stable=True)
    probs = torch.softmax(values, dim=0)
    if params.top_p < 1.0:
        cumulative = torch.cumsum(probs, dim=0)
        # Keep the smallest head whose mass reaches top_p (always at least one token).
        keep = int(torch.searchsorted(cumulative, torch.tensor(params.top_p, dtype=torch.float64)))
        probs = probs[: keep + 1]
    cumulative = torch.cumsum(probs, dim=0)
    u = seeded_uniform(seed, position) * float(cumulative[-1])
    idx = int(torch.searchsorted(cumulative, torch.tensor(u, dtype=torch.float64), right=True))
    return int(indices[min(idx, probs.shape[0] - 1)].item())


def sample(
    logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], positions: list[int]
) -> list[int]:
    """One token per row; greedy rows share a single argmax call."""
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    out = [0] * len(params)
    if greedy_rows:
        picks = torch.argmax(logits[greedy_rows], dim=-1).tolist()
        for i, tok in zip(greedy_rows, picks, strict=True):
            out[i] = int(tok)
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = sample_row(logits[i], p, seeds[i], positions[i])
    return out
