"""A decode node as a stream's standby: it loads the stream's stored KV ahead of a failure.

A resume after a decode node dies loads the stream's checkpoint from the kvcache service
first (at 2,048 tokens of context, 95 MB: about as long as the resume's decode step). So,
once a stream is under way, its router picks another decode node as its standby and sends
it a `Prefetch` of the stream's context; the standby loads the blocks stored so far into
its pool as cached blocks, evictable like any other, and the router resumes the stream
there if its node dies. The resume then finds most of its context in the pool and loads
only the blocks stored since, and the partial last block.

Best effort and bounded: one prefetch at a time (hints meanwhile are dropped), none while
draining, and only when the pool has room for twice the context, so a standby copy never
crowds out the node's own streams.
"""

from __future__ import annotations

import logging

from nats.aio.msg import Msg

from services.decode.local_prefill import load_prefix
from services.decode.streams import DecodeNode
from shared.bus.client import Bus
from shared.bus.messages import Prefetch, decode
from shared.connector.prefix_cache import PrefixCache
from shared.engine.interface import EngineCore
from shared.errors import WireFormatError

log = logging.getLogger("tandem.decode")
PREFETCH_TIMEOUT = 5.0  # seconds for one prefetch's load from kvcache (as for a prefix)
MAX_PREFETCHES = 1  # at once


class Standby:
    """A decode worker's part: the prefetches it takes as another stream's standby."""

    def __init__(
        self, node: DecodeNode, engine: EngineCore, bus: Bus, prefix: PrefixCache | None
    ) -> None:
        self.node = node
        self.engine = engine
        self.bus = bus
        self.prefix = prefix
        self.prefetching = 0  # prefetches under way
        self.prefetched_blocks = 0

    async def on_prefetch(self, msg: Msg) -> None:
        try:
            hint = decode(msg.data, Prefetch)
            if len(hint.token_ids) > self.engine.max_model_len:
                raise WireFormatError("prefetch context longer than the model's")
        except WireFormatError as exc:
            self.bus.count_drop(msg.subject, str(exc))
            return
        if self.node.draining or self.prefix is None or self.prefetching >= MAX_PREFETCHES:
            return
        need = self.engine.blocks_for(len(hint.token_ids))
        if self.node.free_blocks() < 2 * need:
            return
        self.prefetching += 1
        try:
            hashes, blocks = await load_prefix(
                self.prefix, hint.token_ids, PREFETCH_TIMEOUT, hint.cache_salt
            )
            if hashes:
                placed = await self.node.on_engine(
                    self.engine.exchange.import_cached_blocks, hashes, blocks
                )
                self.prefetched_blocks += placed
                log.debug("standby for %s: %d KV blocks loaded", hint.attempt_id, placed)
        except Exception as exc:  # best effort: a resume loads them itself
            log.warning("prefetch for %s failed: %r", hint.attempt_id, exc)
        finally:
            self.prefetching -= 1
