"""Times read off a profile (profile.py): what one engine step, one prefill batch and one
KV transfer take, by interpolating the measured (or projected) points.

- prefill: seconds against the tokens one forward computes (summed over the sequences
  packed into it), piecewise linear through every point (batch-1 and batched points
  together, keyed by their total tokens), extended linearly beyond the last two;
- decode: seconds of one step against batch size and context (mean tokens of KV per
  sequence), bilinear over the measured grid, extended linearly outside it;
- transfer: seconds against bytes on the profile's transport, piecewise linear.

What this does not capture (and so the simulator does not): a chunk's extra attention over
the chunks before it, two processes competing for the same cores, Python and NATS work
between steps beyond what the profile's engine steps include.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from shared.costs.profile import KV_COPY_OPS, KVCopyOp, Profile


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """y at x on the polyline through (xs, ys) (xs ascending), extended linearly from its
    end segments; never below zero. One point: that value everywhere."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def _polyline(pairs: Sequence[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """Points sorted by x, repeated xs averaged."""
    merged: dict[float, list[float]] = {}
    for x, y in pairs:
        merged.setdefault(x, []).append(y)
    xs = sorted(merged)
    return xs, [sum(merged[x]) / len(merged[x]) for x in xs]


class CostModel:
    """A profile's points, ready to answer "how long" questions fast (the simulator asks
    once per simulated step)."""

    def __init__(self, profile: Profile, transport: str | None = None) -> None:
        if not profile.prefill or not profile.decode:
            raise ValueError("the profile has no prefill or no decode points")
        self.profile = profile
        self.kv_bytes_per_token = profile.kv_bytes_per_token
        self._prefill = _polyline([(p.tokens * p.batch, p.seconds) for p in profile.prefill])
        # decode: for each measured context, the step time against batch
        self._contexts = sorted({p.context for p in profile.decode})
        self._by_context = [
            _polyline([(p.batch, p.seconds) for p in profile.decode if p.context == c])
            for c in self._contexts
        ]
        kinds = sorted({t.transport for t in profile.transfer})
        self.transport = transport or (kinds[0] if kinds else "")
        if transport is not None and transport not in kinds:
            raise ValueError(f"the profile has no {transport!r} transfers (it has {kinds})")
        self._transfer = _polyline(
            [(t.bytes, t.seconds) for t in profile.transfer if t.transport == self.transport]
        )
        self._decode_memo: dict[tuple[int, int], float] = {}
        self._kv_copy = {
            op: _polyline([(p.tokens, p.seconds) for p in profile.kv_copy if p.op == op])
            for op in KV_COPY_OPS
        }

    def prefill(self, tokens: int) -> float:
        """One forward computing `tokens` prompt tokens (of one or several sequences)."""
        return interpolate(*self._prefill, tokens) if tokens > 0 else 0.0

    def decode(self, batch: int, context: float) -> float:
        """One decode step of `batch` sequences averaging `context` tokens of KV."""
        if batch <= 0:
            return 0.0
        key = (batch, int(context) // 16)  # the step time barely moves within a block
        if (hit := self._decode_memo.get(key)) is not None:
            return hit
        at = [interpolate(xs, ys, batch) for xs, ys in self._by_context]
        value = interpolate(self._contexts, at, key[1] * 16 + 8)
        if len(self._decode_memo) < 1 << 16:
            self._decode_memo[key] = value
        return value

    def decode_run(self, batch: int, context: float, steps: int) -> list[tuple[float, int]]:
        """`steps` decode steps in a row of the same batch, from `context` (one more token of
        KV per step): runs of (seconds of each step, steps), as `decode` times each step."""
        runs: list[tuple[float, int]] = []
        c = int(context)  # int(context + j) // 16 == (c + j) // 16: the same memo keys
        while steps > 0:
            n = min(steps, 16 - c % 16)
            runs.append((self.decode(batch, c), n))
            c, steps = c + n, steps - n
        return runs

    def transfer(self, nbytes: int) -> float:
        """Moving `nbytes` of KV between two nodes (0 without transfer points: same node)."""
        if nbytes <= 0 or not self._transfer[0]:
            return 0.0
        return interpolate(*self._transfer, nbytes)

    def kv_transfer(self, tokens: int) -> float:
        return self.transfer(tokens * self.kv_bytes_per_token)

    def kv_copy(self, op: KVCopyOp, tokens: int) -> float:
        """An engine thread's copy of `tokens` tokens of KV (0 when the profile has no such
        points: written before they were measured, or projected)."""
        xs, ys = self._kv_copy[op]
        if tokens <= 0 or not xs:
            return 0.0
        return interpolate(xs, ys, tokens)
