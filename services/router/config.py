"""The router's settings (from its command line: services/router/main.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.router.validation import Limits


@dataclass
class RouterConfig:
    node_id: str = "router"
    max_inflight: int = 256
    max_body_bytes: int = 1 << 20
    body_timeout: float = 10.0  # seconds for a request's whole body, once its headers came
    first_token_timeout: float = 120.0
    stall_timeout: float = 30.0
    request_timeout: float = 600.0  # whole request, streaming included
    limits: Limits = field(default_factory=Limits)
    colocated: bool = False  # no prefill nodes: decode nodes prefill every request
    standby_after: int = 16  # delivered tokens before a stream gets a standby (0: never)
    isolate_cache_by_key: bool = False  # salt every request's blocks with its key's digest
