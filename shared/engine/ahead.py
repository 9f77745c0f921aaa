"""Decoding ahead: an engine whose every step runs up to `k` steps of another, and returns
each request's tokens of all of them as one output (`--decode-ahead K` on a decode node).

It is what the engine seam promises above the engine: a step may bring several tokens per
sequence (as speculative decoding and multi-step scheduling do), and nothing in the planes,
the router, checkpoints or failover may count steps for tokens. Run with K > 1, the whole
stack is exercised on that promise with the native engine, greedy-identical by design: the
inner steps are the same forwards. What it trades: a new request waits up to K inner steps
to be admitted, and tokens reach the client K at a time (fewer messages, burstier gaps).

Blocks filled and tails grown during the inner steps are taken between them (the engine
may reuse a finished sequence's blocks in the next inner step), and handed out together at
the next take, so a checkpoint sees every block it would have seen step by step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from shared.engine.interface import BlockMoves, EngineCore, KVPool, TailMoves
from shared.engine.types import (
    CheckpointPoint,
    EngineStats,
    SequenceState,
    StepOutput,
)
from shared.kv.block_hash import BlockHash
from shared.kv.paged_cache import KVLayout
from shared.kv.tail import TailBlock
from shared.sampling_params import SamplingParams

MAX_AHEAD = 64


def text_ends(out: StepOutput) -> list[int] | None:
    """The length of `out.text` after each of its tokens (None: not known)."""
    if out.text_ends is not None:
        return out.text_ends
    return [len(out.text)] if len(out.new_token_ids) == 1 else None


def merged(a: StepOutput, b: StepOutput) -> StepOutput:
    """`a` then `b`, the same request's outputs of two steps in a row, as one."""
    ends_a, ends_b = text_ends(a), text_ends(b)
    ends = None
    if ends_a is not None and ends_b is not None:
        ends = ends_a + [len(a.text) + e for e in ends_b]
    logprobs = None
    if a.logprobs is not None or b.logprobs is not None:
        logprobs = (a.logprobs or []) + (b.logprobs or [])
    return StepOutput(
        request_id=a.request_id,
        new_token_ids=a.new_token_ids + b.new_token_ids,
        text=a.text + b.text,
        finished=b.finished,
        finish_reason=b.finish_reason,
        num_prompt_tokens=b.num_prompt_tokens,
        num_output_tokens=b.num_output_tokens,
        num_cached_tokens=b.num_cached_tokens,
        logprobs=logprobs,
        prompt_logprobs=a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs,
        text_ends=ends,
    )


class _Blocks:
    """The inner engine's block moves, with what inner steps filled kept between takes."""

    def __init__(self, inner: BlockMoves) -> None:
        self.inner = inner
        self._hashes: list[BlockHash] = []
        self._blocks: list[memoryview] = []
        self._points: dict[str, CheckpointPoint] = {}

    @property
    def collect_filled(self) -> bool:
        return self.inner.collect_filled

    @collect_filled.setter
    def collect_filled(self, value: bool) -> None:
        self.inner.collect_filled = value

    @property
    def checkpoint_every(self) -> int:
        return self.inner.checkpoint_every

    @checkpoint_every.setter
    def checkpoint_every(self, value: int) -> None:
        self.inner.checkpoint_every = value

    @property
    def on_blocks_named(self) -> Callable[[list[BlockHash]], None] | None:
        return self.inner.on_blocks_named

    @on_blocks_named.setter
    def on_blocks_named(self, value: Callable[[list[BlockHash]], None] | None) -> None:
        self.inner.on_blocks_named = value

    def prompt_block_hashes(self, prompt_ids: list[int], cache_salt: str = "") -> list[BlockHash]:
        return self.inner.prompt_block_hashes(prompt_ids, cache_salt)

    def context_block_hashes(self, token_ids: list[int], cache_salt: str = "") -> list[BlockHash]:
        return self.inner.context_block_hashes(token_ids, cache_salt)

    def cached_prefix_blocks(self, hashes: list[BlockHash]) -> int:
        return self.inner.cached_prefix_blocks(hashes)

    def import_cached_blocks(
        self, hashes: list[BlockHash], blocks: Sequence[bytes | memoryview]
    ) -> int:
        return self.inner.import_cached_blocks(hashes, blocks)

    def gather(self) -> None:
        """Between inner steps: copy out what they filled before it can be reused."""
        if not self.inner.collect_filled:
            return
        hashes, blocks = self.inner.take_filled_blocks()
        self._hashes += hashes
        self._blocks += blocks
        for point in self.inner.take_checkpoint_points():
            self._points[point.request_id] = point  # the latest per sequence

    def take_filled_blocks(self) -> tuple[list[BlockHash], list[memoryview]]:
        self.gather()
        out = self._hashes, self._blocks
        self._hashes, self._blocks = [], []
        return out

    def take_checkpoint_points(self) -> list[CheckpointPoint]:
        """After `take_filled_blocks` (a point follows its blocks): the latest of each."""
        points, self._points = list(self._points.values()), {}
        return points


class _Tails:
    """The inner engine's tails, with the pieces inner steps grew kept between takes."""

    def __init__(self, inner: TailMoves) -> None:
        self.inner = inner
        self._pieces: list[TailBlock] = []

    @property
    def collect(self) -> bool:
        return self.inner.collect

    @collect.setter
    def collect(self, value: bool) -> None:
        self.inner.collect = value

    def gather(self) -> None:
        self._pieces += self.inner.take()  # in order: each piece extends the one before

    def take(self) -> list[TailBlock]:
        self.gather()
        pieces, self._pieces = self._pieces, []
        return pieces

    def resend(self, request_ids: list[str]) -> None:
        self.inner.resend(request_ids)

    def fit(self, tail: TailBlock, context: list[int], cache_salt: str = "") -> TailBlock | None:
        return self.inner.fit(tail, context, cache_salt)


class DecodeAhead:
    """An `EngineCore` running up to `k` steps of `inner` per step."""

    def __init__(self, inner: EngineCore, k: int) -> None:
        if not 1 <= k <= MAX_AHEAD:
            raise ValueError(f"decode-ahead must be between 1 and {MAX_AHEAD}, got {k}")
        self.inner = inner
        self.k = k
        self._blocks = _Blocks(inner.exchange)
        self._tails = _Tails(inner.tails)

    def step(self) -> list[StepOutput]:
        outputs: dict[str, StepOutput] = {}
        for i in range(self.k):
            if i:
                if not self.inner.has_unfinished():
                    break
                self._blocks.gather()
                self._tails.gather()
            for out in self.inner.step():
                before = outputs.get(out.request_id)
                outputs[out.request_id] = out if before is None else merged(before, out)
        return list(outputs.values())

    # ---- the rest is the inner engine's ---------------------------------------------------

    @property
    def exchange(self) -> BlockMoves:
        return self._blocks

    @property
    def tails(self) -> TailMoves:
        return self._tails

    @property
    def kind(self) -> str:
        return self.inner.kind

    @property
    def served_name(self) -> str:
        return self.inner.served_name

    @property
    def max_model_len(self) -> int:
        return self.inner.max_model_len

    @property
    def block_size(self) -> int:
        return self.inner.block_size

    @property
    def hash_key(self) -> str:
        return self.inner.hash_key

    @property
    def layout(self) -> KVLayout:
        return self.inner.layout

    @property
    def pool(self) -> KVPool:
        return self.inner.pool

    @property
    def stats(self) -> EngineStats:
        return self.inner.stats

    @property
    def num_running(self) -> int:
        return self.inner.num_running

    @property
    def num_waiting(self) -> int:
        return self.inner.num_waiting

    @property
    def num_waiting_midstream(self) -> int:
        return self.inner.num_waiting_midstream

    def serves(self, model: str) -> bool:
        return self.inner.serves(model)

    def blocks_for(self, num_tokens: int) -> int:
        return self.inner.blocks_for(num_tokens)

    def validate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        output_ids: list[int] | None = None,
    ) -> None:
        self.inner.validate(request_id, prompt_ids, params, output_ids)

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        output_ids: list[int] | None = None,
        tail: TailBlock | None = None,
    ) -> str:
        return self.inner.add_request(prompt_ids, params, request_id, output_ids, tail)

    def add_snapshot(self, snapshot: SequenceState, kv_frame: bytes | memoryview) -> str:
        return self.inner.add_snapshot(snapshot, kv_frame)

    def export(self, request_id: str) -> tuple[SequenceState, memoryview]:
        return self.inner.export(request_id)

    def abort(self, request_id: str) -> bool:
        return self.inner.abort(request_id)

    def cancel_all(self) -> None:
        self.inner.cancel_all()

    def has_unfinished(self) -> bool:
        return self.inner.has_unfinished()

    def running_tokens(self) -> dict[str, int]:
        return self.inner.running_tokens()
