"""Keep a proven connection from every kvcache node to this node, for its first get.

A prefill or decode node asks each kvcache node it sees in the registry to warm the
connection that node's gets to it will take (`KVCacheClient.warm`: a one-byte transfer
under a secret this node names; `services/kvcache/warm.py` says why a transfer). A new
kvcache node is asked within a round; each is asked again every `REWARM_EVERY` seconds, so
a connection that was dropped is reopened before a failover needs it. Best effort: a
kvcache node that does not answer is asked again next round.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from shared.kvclient.client import KVCacheClient

log = logging.getLogger("tandem.kvclient")

WARM_EVERY = 2.0  # seconds between looks at the kvcache nodes
REWARM_EVERY = 15.0  # seconds before a warmed kvcache node is asked again
WARM_TIMEOUT = 5.0


async def keep_warm(client: KVCacheClient, stop: asyncio.Event) -> None:
    warmed: dict[str, float] = {}  # kvcache node id -> when it last warmed its connection
    while not stop.is_set():
        nodes = await client.nodes()
        now = time.monotonic()
        for node in nodes:
            if stop.is_set():
                return
            if now - warmed.get(node.node_id, -REWARM_EVERY) < REWARM_EVERY:
                continue
            try:
                await client.warm(node.node_id, WARM_TIMEOUT)
                warmed[node.node_id] = time.monotonic()
            except Exception as exc:  # down or busy now: the next round asks again
                log.debug("kvcache %s did not warm a connection: %r", node.node_id, exc)
        live = {n.node_id for n in nodes}
        for gone in [n for n in warmed if n not in live]:
            del warmed[gone]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), WARM_EVERY)
