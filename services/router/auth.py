"""Bearer API keys at the router, and how many requests each key may have in flight.

Keys come from `--api-keys` (comma-separated; usually `TANDEM_API_KEYS`) and/or
`--api-keys-file` (one key per line, `#` comments). With no key configured the API is open
(and `tandem up` says so). Only SHA-256 digests of the keys are held, every presented key is
compared with every configured digest in constant time (no early exit that would leak which
prefix matched), and a key is never logged: logs and metrics see its short fingerprint.

`/healthz` and `/readyz` stay open (orchestrators probe them without secrets); `/metrics`
is open unless `--metrics-auth`.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from aiohttp.typedefs import Middleware

from shared.errors import AuthenticationError, RateLimitError, TandemError

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/version"})
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def fingerprint(key: str) -> str:
    """What logs and metrics may show of a key: enough to tell keys apart, not to use one."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


def owner_digest(key: str) -> str:
    """What binds a request to the key that made it (kept in the journal, which every node
    can read): a domain-separated SHA-256, useless as a key and distinct from `_digest`."""
    return hashlib.sha256(b"tandem-request-owner\0" + key.encode()).hexdigest()


def request_owner(request: web.Request) -> str:
    """The owner digest of the key this request was authenticated with ("" on an open API)."""
    return str(request.get("owner", ""))


def read_keys(inline: str | None, path: str | None) -> list[str]:
    keys = [k.strip() for k in (inline or "").split(",") if k.strip()]
    if path:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as exc:
            raise TandemError(f"--api-keys-file {path}: {exc}") from exc
        keys += [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    short = [fingerprint(k) for k in keys if len(k) < 16]
    if short:
        raise TandemError(f"API keys must be at least 16 characters ({', '.join(short)})")
    return keys


@dataclass
class ApiKeys:
    digests: list[bytes]
    max_inflight_per_key: int = 64
    protect_metrics: bool = False

    @classmethod
    def of(
        cls, keys: list[str], max_inflight_per_key: int = 64, protect_metrics: bool = False
    ) -> ApiKeys:
        return cls([_digest(k) for k in keys], max_inflight_per_key, protect_metrics)

    @property
    def enabled(self) -> bool:
        return bool(self.digests)

    def check(self, presented: str) -> bool:
        digest = _digest(presented)
        match = False
        for known in self.digests:  # all of them, always: the time says nothing
            match |= hmac.compare_digest(digest, known)
        return match


def _presented_key(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return None


def auth_middleware(keys: ApiKeys, on_reject: Callable[[str], None]) -> Middleware:
    """Reject unauthenticated requests (401) and a key's requests beyond its share (429).

    The in-flight count spans the whole handler, streaming included, so a key holding
    many long streams cannot starve the others."""
    inflight: dict[str, int] = {}

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in OPEN_PATHS or (request.path == "/metrics" and not keys.protect_metrics):
            return await handler(request)
        if not keys.enabled:  # an open API: only the router-wide --max-inflight applies
            return await handler(request)
        presented = _presented_key(request)
        if presented is None or not keys.check(presented):
            on_reject("401")
            raise AuthenticationError(
                "missing or invalid API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )
        who = fingerprint(presented)
        if inflight.get(who, 0) >= keys.max_inflight_per_key:
            on_reject("429")
            raise RateLimitError(
                f"this API key already has {keys.max_inflight_per_key} requests in flight",
                code="too_many_concurrent_requests",
                retry_after=1,
            )
        inflight[who] = inflight.get(who, 0) + 1
        request["api_key"] = who
        request["owner"] = owner_digest(presented)
        extra = 0

        def claim(count: int) -> None:
            """`count` more of this key's slots (a request's further choices), or 429."""
            nonlocal extra
            if inflight[who] + count > keys.max_inflight_per_key:
                on_reject("429")
                raise RateLimitError(
                    f"this API key has room for {keys.max_inflight_per_key - inflight[who]} "
                    f"more sequences in flight, and the request asks for {count + 1}",
                    code="too_many_concurrent_requests",
                    retry_after=1,
                )
            inflight[who] += count
            extra += count

        request["claim_key_slots"] = claim
        try:
            return await handler(request)
        finally:
            inflight[who] -= 1 + extra
            if not inflight[who]:
                del inflight[who]

    return middleware
