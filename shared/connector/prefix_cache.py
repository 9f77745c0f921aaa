"""A node's use of the kvcache service for prefixes: load a prompt's cached prefix, store
new blocks.

Before a prefill (a prefill node's batch, or a decode node prefilling a request itself, a
resumed one included): the blocks of the prompt's longest cached prefix beyond what the
node's own pool holds are fetched from the kvcache nodes (sharded, best effort) and then
placed in the pool on the engine thread, right before the prefill that uses them. After
(prefill nodes): the prompt's full blocks that no cache supplied are queued for upload in
the background (decode nodes upload what they fill their own way).
"""

from __future__ import annotations

from opentelemetry import context as otel_context
from opentelemetry.trace import SpanContext

from shared.engine.interface import EngineCore
from shared.engine.types import StepOutput
from shared.kv.block_hash import BlockHash
from shared.kv.export import split_frame
from shared.kvclient.client import KVCacheClient
from shared.kvclient.uploader import BlockUploader
from shared.telemetry.metrics import NodeMetrics
from shared.telemetry.tracing import tracer

TRACER = tracer("prefill")


class PrefixCache:
    def __init__(
        self, engine: EngineCore, cache: KVCacheClient | None, upload: bool = True
    ) -> None:
        self.engine = engine
        self.cache = cache
        self.uploader = BlockUploader(cache) if cache is not None and upload else None
        self.loaded_blocks = 0  # prefix blocks fetched from the kvcache service

    def add_metrics(self, metrics: NodeMetrics) -> None:
        metrics.gauge(
            "tandem_prefix_cache_loaded_blocks",
            "Prefix blocks loaded from the kvcache service",
            lambda: self.loaded_blocks,
        )
        up = self.uploader
        if up is not None:
            metrics.gauge(
                "tandem_kvcache_stored_blocks", "Blocks handed to kvcache", lambda: up.stored
            )
            metrics.gauge(
                "tandem_kvcache_store_dropped_blocks",
                "Blocks not stored (upload queue full)",
                lambda: up.dropped,
            )

    def start(self) -> None:
        if self.uploader is not None:
            self.uploader.start()

    async def close(self) -> None:
        if self.uploader is not None:
            await self.uploader.drain(2.0)
            await self.uploader.close()

    async def load(
        self, token_ids: list[int], ctx: otel_context.Context, cache_salt: str = ""
    ) -> tuple[list[BlockHash], list[memoryview]]:
        """Blocks of the cached prefix of `token_ids` (a request with `cache_salt`) that this
        node's pool lacks."""
        if self.cache is None:
            return [], []
        hashes = self.engine.exchange.prompt_block_hashes(token_ids, cache_salt)
        local = self.engine.exchange.cached_prefix_blocks(hashes)
        if local >= len(hashes):
            return [], []
        with TRACER.start_as_current_span(
            "kvcache.load_prefix",
            context=ctx,
            attributes={"tandem.blocks_asked": len(hashes) - local, "tandem.local_blocks": local},
        ) as span:
            size = self.engine.layout.bytes_per_block
            blocks = await self.cache.load_prefix(hashes[local:], size)
            span.set_attribute("tandem.blocks_loaded", len(blocks))
            span.set_attribute("tandem.bytes", len(blocks) * size)
            self.loaded_blocks += len(blocks)
            return hashes[local : local + len(blocks)], blocks

    def store(
        self,
        token_ids: list[int],
        out: StepOutput,
        frame: memoryview,
        request: SpanContext | None = None,
        cache_salt: str = "",
    ) -> None:
        """Queue the full blocks of `token_ids` that did not come from a cache for kvcache."""
        if self.uploader is None:
            return
        hashes = self.engine.exchange.context_block_hashes(token_ids, cache_salt)
        first = out.num_cached_tokens // self.engine.block_size
        if first >= len(hashes):
            return
        _, payload = split_frame(frame)
        size = self.engine.layout.bytes_per_block
        self.uploader.submit(
            hashes[first:],
            [payload[i * size : (i + 1) * size] for i in range(first, len(hashes))],
            [request] if request is not None else [],
        )
