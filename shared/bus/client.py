"""A NATS connection that reconnects forever, reports its state, and drains on shutdown.

Services read `bus.is_connected` (nats-py's own state) for readiness: while the server is
away they report not ready, and nats-py keeps reconnecting with a short wait (0.2 s:
measured ~5 ms to recover after a server restart). Publishing helpers add the trace
context and de-duplication id headers, and refuse bodies that would break the
connection's max_payload.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import nats
from nats.aio.client import Client
from nats.js import JetStreamContext

from shared.bus.auth import BusAuth
from shared.bus.messages import Message, encode
from shared.bus.tracing import inject_headers
from shared.errors import Stopped, TandemError
from shared.tasks import cancel_and_wait

log = logging.getLogger("tandem.bus")

REQUEST_TIMEOUT = 5.0
HEADER_ROOM = 4096  # bytes kept free for headers under max_payload


class Bus:
    """One NATS connection plus its JetStream context."""

    def __init__(self, url: str, name: str, auth: BusAuth | None = None) -> None:
        self.url = url
        self.name = name
        self.auth = auth or BusAuth()
        self.nc: Client | None = None
        self.js: JetStreamContext | None = None
        self.dropped: Counter[str] = Counter()  # malformed messages by subject
        self.reconnects = 0
        self.reconnected_at = -1e9  # time.monotonic() of the last reconnection
        # Run after every reconnect (e.g. re-creating the topology: a restarted server has
        # lost its memory-backed streams, the node registry among them).
        self.on_reconnect: list[Callable[[], Awaitable[None]]] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def connect(self, timeout: float = 10.0, stop: asyncio.Event | None = None) -> Bus:
        """Connect, retrying while the server is unreachable, until connected or `stop` is
        set (raises Stopped: a node asked to stop before NATS is up must still end)."""

        async def disconnected() -> None:
            log.warning("nats disconnected", extra={"node": self.name})

        async def reconnected() -> None:
            self.reconnects += 1
            self.reconnected_at = time.monotonic()
            log.info("nats reconnected", extra={"node": self.name})
            for callback in self.on_reconnect:
                task = asyncio.ensure_future(callback())
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

        refused = asyncio.Event()

        async def error(exc: Exception) -> None:
            if "authorization" in str(exc).lower():
                refused.set()
            log.warning("nats error: %s", exc, extra={"node": self.name})

        # nats-py retries a first connection forever too (right while the server starts, as
        # under compose), but wrong credentials never get better: fail fast on those.
        connecting = asyncio.ensure_future(
            nats.connect(
                # Several servers of one cluster, comma-separated: any one will do (the
                # cluster then tells the client of the others as well).
                [u.strip() for u in self.url.split(",")] if "," in self.url else self.url,
                name=self.name,
                connect_timeout=timeout,
                reconnect_time_wait=0.2,
                max_reconnect_attempts=-1,
                allow_reconnect=True,
                disconnected_cb=disconnected,
                reconnected_cb=reconnected,
                error_cb=error,
                **self.auth.connect_kwargs(),
            )
        )
        rejected = asyncio.ensure_future(refused.wait())
        stopped = asyncio.ensure_future(stop.wait() if stop else asyncio.Event().wait())
        await asyncio.wait({connecting, rejected, stopped}, return_when=asyncio.FIRST_COMPLETED)
        rejected.cancel()
        stopped.cancel()
        if not connecting.done():
            await cancel_and_wait(connecting)
            if stop is not None and stop.is_set():
                raise Stopped(f"asked to stop while connecting to NATS at {self.url}")
            raise TandemError(
                f"NATS at {self.url} refused this node's credentials "
                "(--nats-user/--nats-password or --nats-creds)"
            )
        self.nc = connecting.result()
        self.js = self.nc.jetstream(timeout=REQUEST_TIMEOUT)
        return self

    @property
    def is_connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    def _check_size(self, data: bytes) -> None:
        assert self.nc is not None
        if len(data) + HEADER_ROOM > self.nc.max_payload:
            raise ValueError(
                f"{len(data)} bytes exceed the server's max_payload {self.nc.max_payload} "
                "less header room; bulk data belongs on the data plane"
            )

    async def publish(
        self, subject: str, msg: Message, headers: dict[str, str] | None = None
    ) -> None:
        """Core NATS publish (at most once) with trace context."""
        assert self.nc is not None, "connect() first"
        data = encode(msg)
        self._check_size(data)
        await self.nc.publish(subject, data, headers=inject_headers(headers))

    async def js_publish(
        self, subject: str, msg: Message, msg_id: str | None = None, **kwargs: Any
    ) -> Any:
        """JetStream publish; `msg_id` sets Nats-Msg-Id so a retried publish is stored once."""
        assert self.js is not None, "connect() first"
        data = encode(msg)
        self._check_size(data)
        headers = inject_headers({"Nats-Msg-Id": msg_id} if msg_id else None)
        return await self.js.publish(subject, data, headers=headers, **kwargs)

    def count_drop(self, subject: str, reason: str) -> None:
        self.dropped[subject] += 1
        log.warning("dropped malformed message on %s: %s", subject, reason)

    async def close(self) -> None:
        """Drain subscriptions and pending publishes, then close."""
        if self.nc is not None and not self.nc.is_closed:
            try:
                await asyncio.wait_for(self.nc.drain(), timeout=2.0)
            except (TimeoutError, nats.errors.Error):
                await self.nc.close()
