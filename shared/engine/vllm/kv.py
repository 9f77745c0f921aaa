"""The KV side of the seam for vLLM's engine, as far as it goes today: its block pool's
counts, and block and tail moves that move nothing.

vLLM keeps its KV in its own paged cache; Tandem's planes reach it only through a KV
connector (vLLM's `KVConnectorBase_V1`), which is not written yet (issue 51). Until it is, a
vLLM node names no blocks, stores no checkpoints and loads no prefix or tail: a stream
whose node dies resumes on another by recomputing its context (exact for greedy streams),
and prefix reuse happens inside each node (vLLM's own prefix cache) but not across nodes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from shared.engine.types import CheckpointPoint
from shared.kv.block_hash import BlockHash
from shared.kv.tail import TailBlock


class VllmPool:
    """vLLM's block pool, counted as Tandem's nodes count theirs (its null block aside)."""

    def __init__(self, block_pool: Any) -> None:
        self._pool = block_pool
        self.on_evict: Callable[[int, BlockHash], None] | None = None  # never called: see above

    @property
    def num_blocks(self) -> int:
        return int(self._pool.num_gpu_blocks) - 1

    @property
    def num_free(self) -> int:
        return min(self.num_blocks, int(self._pool.get_num_free_blocks()))

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free


class NoBlockMoves:
    """`BlockMoves` with no connector: no hashes, nothing cached to import, nothing filled."""

    def __init__(self) -> None:
        self.collect_filled = False
        self.checkpoint_every = 1
        self.on_blocks_named: Callable[[list[BlockHash]], None] | None = None

    def prompt_block_hashes(self, prompt_ids: list[int], cache_salt: str = "") -> list[BlockHash]:
        return []

    def context_block_hashes(self, token_ids: list[int], cache_salt: str = "") -> list[BlockHash]:
        return []

    def cached_prefix_blocks(self, hashes: list[BlockHash]) -> int:
        return 0

    def import_cached_blocks(
        self, hashes: list[BlockHash], blocks: Sequence[bytes | memoryview]
    ) -> int:
        return 0

    def take_filled_blocks(self) -> tuple[list[BlockHash], list[memoryview]]:
        return [], []

    def take_checkpoint_points(self) -> list[CheckpointPoint]:
        return []


class NoTailMoves:
    """`TailMoves` with no connector: no tails out, none fits."""

    def __init__(self) -> None:
        self.collect = False

    def take(self) -> list[TailBlock]:
        return []

    def resend(self, request_ids: list[str]) -> None:
        return None

    def fit(self, tail: TailBlock, context: list[int], cache_salt: str = "") -> TailBlock | None:
        return None
