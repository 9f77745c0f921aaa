"""Errors at the router's edge: every TandemError becomes the OpenAI error shape here, once.

The router's modules raise the types of `shared/errors.py` (each knows its HTTP status and
OpenAI error type); this module turns one into a response, with `Retry-After` when the
error says when to come back. aiohttp's own HTTP errors (a body over the size limit, an
unknown path) are mapped to the same shape.
"""

from __future__ import annotations

import math

from aiohttp import web

from shared.errors import PayloadTooLargeError, TandemError

_TYPES_BY_STATUS = {401: "authentication_error", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(exc: TandemError) -> dict[str, object]:
    """`{"error": {"message", "type", "param", "code"}}`, as OpenAI sends it."""
    return {
        "error": {
            "message": exc.message,
            "type": exc.error_type,
            "param": exc.param,
            "code": exc.code,
        }
    }


def error_headers(exc: TandemError) -> dict[str, str]:
    headers = {}
    if exc.retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
    if exc.http_status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return headers


def error_response(exc: TandemError) -> web.Response:
    return web.json_response(error_body(exc), status=exc.http_status, headers=error_headers(exc))


class HttpError(TandemError):
    """An error aiohttp raised itself (unknown path, wrong method), with its own status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.http_status = status
        self.error_type = _TYPES_BY_STATUS.get(status, "invalid_request_error")


def from_http_exception(exc: web.HTTPException) -> TandemError:
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return PayloadTooLargeError("request body too large")
    return HttpError(exc.status, exc.reason or "error")
