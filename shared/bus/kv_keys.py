"""The live keys of a JetStream KV bucket, listed without nats-py's `KeyValue.keys()` race.

`keys()` decides that a bucket is empty when the consumer it creates has nothing pending
on the server and the client has read nothing yet. The server may already have sent
every entry (pending 0) while the client has not read them: on a loaded host the listing
then comes back empty although the bucket is not (a CI run met it). Here the end is
decided from the server's side only: the consumer's delivered count plus its pending
count is how many entries the snapshot has, and the last one says nothing is pending.
"""

from __future__ import annotations

import asyncio

from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from nats.js.kv import KV_MARKER_REASON, KV_OP

READ_TIMEOUT = 5.0  # seconds to wait for the next entry of a snapshot being sent


async def live_keys(js: JetStreamContext, bucket: str, timeout: float = READ_TIMEOUT) -> list[str]:
    """The keys whose latest entry is a value (not a delete, purge or expiry marker), in
    stream order. Raises on a NATS error or when the snapshot stalls for `timeout`."""
    prefix = f"$KV.{bucket}."
    arrived: asyncio.Queue[Msg] = asyncio.Queue()

    async def take(msg: Msg) -> None:
        arrived.put_nowait(msg)

    sub = await js.subscribe(
        prefix + ">",
        stream=f"KV_{bucket}",
        cb=take,
        ordered_consumer=True,
        deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
        headers_only=True,
        inactive_threshold=60.0,
    )
    try:
        info = await sub.consumer_info()
        sent = info.delivered.consumer_seq if info.delivered is not None else 0
        if (sent or 0) + (info.num_pending or 0) == 0:
            return []
        keys: dict[str, None] = {}
        while True:
            msg = await asyncio.wait_for(arrived.get(), timeout)
            key = msg.subject[len(prefix) :]
            headers = msg.headers or {}
            # a delete or purge (KV_OP), or a marker the server placed (a TTL lapsed)
            if KV_OP in headers or KV_MARKER_REASON in headers:
                keys.pop(key, None)
            else:
                keys[key] = None
            if msg.metadata.num_pending == 0:
                return list(keys)
    finally:
        await sub.unsubscribe()
