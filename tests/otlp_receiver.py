"""A real OTLP/HTTP trace receiver for tests (no Jaeger binary is installable here).

Decodes `ExportTraceServiceRequest` protobufs posted to /v1/traces and keeps the spans.
Runs its own event loop in a thread, so sync fixtures and any test loop can share it.
"""

from __future__ import annotations

import asyncio
import gzip
import threading
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass
class CollectedSpan:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    service: str
    start: int
    end: int
    attributes: dict[str, Any] = field(default_factory=dict)
    events: dict[str, int] = field(default_factory=dict)  # name → time (ns)
    links: list[str] = field(default_factory=list)  # trace ids of linked spans
    status_code: int = 0


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[CollectedSpan] = []
        self.lock = threading.Lock()
        self.requests = 0
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        if body[:2] == b"\x1f\x8b":  # gzip not undone by aiohttp for us
            body = gzip.decompress(body)
        req = ExportTraceServiceRequest()
        req.ParseFromString(body)
        out = []
        for rs in req.resource_spans:
            res = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for sp in ss.spans:
                    out.append(
                        CollectedSpan(
                            trace_id=sp.trace_id.hex(),
                            span_id=sp.span_id.hex(),
                            parent_id=sp.parent_span_id.hex(),
                            name=sp.name,
                            service=str(res.get("tandem.role", res.get("service.name", ""))),
                            start=sp.start_time_unix_nano,
                            end=sp.end_time_unix_nano,
                            attributes={a.key: _value(a.value) for a in sp.attributes},
                            events={e.name: e.time_unix_nano for e in sp.events},
                            links=[link.trace_id.hex() for link in sp.links],
                            status_code=sp.status.code,
                        )
                    )
        with self.lock:
            self.spans.extend(out)
            self.requests += 1
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )

    def start(self) -> str:
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            app = web.Application(client_max_size=64 << 20)
            app.router.add_post("/v1/traces", self._handle)
            self._runner = web.AppRunner(app, access_log=None)
            loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            loop.run_until_complete(site.start())
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            self.url = f"http://127.0.0.1:{port}"
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        ready.wait(10)
        return self.url

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def snapshot(self) -> list[CollectedSpan]:
        with self.lock:
            return list(self.spans)
