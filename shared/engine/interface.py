"""The engine seam: what a prefill or decode node (and `tandem up --colocated`) may ask of an
engine, and nothing else. The native engine (shared/engine/engine.py) is its first
implementation; a node holds an `EngineCore`, so mypy refuses any reach past it.

The contract, in the spirit of vLLM v1's split between an engine core and its KV connector:

- **Requests** (`validate`, `add_request`, `add_snapshot`, `export`, `abort`, `cancel_all`)
  take and give the engine's own types (shared/engine/types.py); the planes map them to
  and from the wire (shared/connector/). Invalid input raises (InvalidRequestError,
  CapacityError, WireFormatError) and changes nothing.
- **Steps** (`step`): each call runs one forward and returns what it produced per request.
  A `StepOutput` may carry several new tokens (an engine that speculates or decodes ahead);
  nothing above the engine may assume one token per step. `num_output_tokens` is the
  sequence's count after them, so a delta numbers its tokens without counting steps.
- **KV, worker side** (`exchange` for full blocks, `tails` for partial last blocks): blocks
  go in by hash (prefix and resume loads), out by hash once filled (checkpoints), and a
  sequence's KV goes out whole with its state (`export`) and comes in whole
  (`add_snapshot`). The layout (`layout`) says what a block is in bytes.
- **Threading**: every call but the counters' reads runs on the one thread that runs
  `step` (shared/runtime/engine_thread.py); counters may be read from any thread and be a
  step stale.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from shared.engine.types import CheckpointPoint, EngineStats, SequenceState, StepOutput
from shared.kv.block_hash import BlockHash
from shared.kv.tail import TailBlock
from shared.sampling_params import SamplingParams

if TYPE_CHECKING:
    from shared.kv.paged_cache import KVLayout


class KVPool(Protocol):
    """The engine's KV block pool, as a node reads it."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def num_free(self) -> int: ...

    @property
    def num_used(self) -> int: ...

    # told (on the engine thread) of each cached block it evicts: (block id, its hash)
    on_evict: Callable[[int, BlockHash], None] | None


class BlockMoves(Protocol):
    """Full KV blocks in and out of the engine's pool, by hash."""

    collect_filled: bool  # keep filled blocks for `take_filled_blocks` (checkpointing)
    checkpoint_every: int  # filled blocks per sequence handed over together
    on_blocks_named: Callable[[list[BlockHash]], None] | None  # the pool holds these now

    def prompt_block_hashes(
        self, prompt_ids: list[int], cache_salt: str = ""
    ) -> list[BlockHash]: ...

    def context_block_hashes(
        self, token_ids: list[int], cache_salt: str = ""
    ) -> list[BlockHash]: ...

    def cached_prefix_blocks(self, hashes: list[BlockHash]) -> int: ...

    def import_cached_blocks(
        self, hashes: list[BlockHash], blocks: Sequence[bytes | memoryview]
    ) -> int: ...

    def take_filled_blocks(self) -> tuple[list[BlockHash], list[memoryview]]: ...

    def take_checkpoint_points(self) -> list[CheckpointPoint]: ...


class TailMoves(Protocol):
    """Running sequences' partly filled last blocks, out after steps and back at a resume."""

    collect: bool  # `take` returns the running sequences' tails (else nothing)

    def take(self) -> list[TailBlock]: ...

    def resend(self, request_ids: list[str]) -> None: ...

    def fit(
        self, tail: TailBlock, context: list[int], cache_salt: str = ""
    ) -> TailBlock | None: ...


class EngineCore(Protocol):
    """One model's engine on a node: requests in, steps, outputs and KV out."""

    # ---- what it is ------------------------------------------------------------------------

    @property
    def kind(self) -> str:
        """Which engine: "native" (shared/engine/engine.py) or "vllm" (shared/engine/vllm/)."""
        ...

    @property
    def served_name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    @property
    def hash_key(self) -> str:
        """What its block hashes are keyed by (model and KV dtype): nodes exchange KV only
        with nodes of the same key."""
        ...

    @property
    def layout(self) -> KVLayout: ...

    @property
    def pool(self) -> KVPool: ...

    @property
    def exchange(self) -> BlockMoves: ...

    @property
    def tails(self) -> TailMoves: ...

    @property
    def stats(self) -> EngineStats: ...

    def serves(self, model: str) -> bool: ...

    def blocks_for(self, num_tokens: int) -> int: ...

    # ---- requests --------------------------------------------------------------------------

    def validate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        output_ids: list[int] | None = None,
    ) -> None: ...

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        output_ids: list[int] | None = None,
        tail: TailBlock | None = None,
    ) -> str: ...

    def add_snapshot(self, snapshot: SequenceState, kv_frame: bytes | memoryview) -> str: ...

    def export(self, request_id: str) -> tuple[SequenceState, memoryview]: ...

    def abort(self, request_id: str) -> bool: ...

    def cancel_all(self) -> None: ...

    # ---- steps -----------------------------------------------------------------------------

    def step(self) -> list[StepOutput]: ...

    def has_unfinished(self) -> bool: ...

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_waiting_midstream(self) -> int:
        """Waiting sequences that made tokens already (preempted, or resumed here)."""
        ...

    def running_tokens(self) -> dict[str, int]:
        """Each running sequence's token count (prompt and output), readable from any
        thread (a racing step may make it a step stale, or empty that once)."""
        ...
