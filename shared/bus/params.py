"""Sampling parameters as they travel on the wire: torch-free, so a process that only
routes (the router) never loads the model stack to read or write them.

The sampler that applies them is `shared/engine/sampling.py`.
"""

from __future__ import annotations

import math
import secrets

import msgspec

from shared.errors import InvalidRequestError

MASK64 = (1 << 64) - 1  # seeds are unsigned 64-bit


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
        if self.seed is not None and not 0 <= self.seed <= MASK64:
            raise bad("seed", "seed must be an integer in [0, 2**64)")
        if any(not s for s in self.stop):
            raise bad("stop", "stop strings must not be empty")


def new_seed() -> int:
    """A seed for a request that gave none: fixed once, so its resumption stays reproducible."""
    return secrets.randbits(63)
