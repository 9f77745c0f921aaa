"""Tandem's error hierarchy: each error carries the request id (if any) and maps to one HTTP status.

The router maps these to the OpenAI error shape once, at its edge; engines and planes raise them.
"""

from __future__ import annotations


class TandemError(Exception):
    """Base of every error Tandem raises on purpose."""

    http_status = 500
    error_type = "server_error"

    def __init__(self, message: str, *, request_id: str | None = None, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.request_id = request_id
        self.param = param

    def __str__(self) -> str:
        prefix = f"[{self.request_id}] " if self.request_id else ""
        return prefix + self.message


class Stopped(Exception):
    """A service was asked to stop (SIGTERM, SIGINT) before it was up: not an error."""


class InvalidRequestError(TandemError):
    """The request itself is wrong (empty prompt, bad parameter, too long)."""

    http_status = 400
    error_type = "invalid_request_error"


class ModelLoadError(TandemError):
    """The model cannot be found, read or converted."""

    error_type = "model_error"


class CapacityError(TandemError):
    """Not enough KV blocks or queue room right now; retrying later or elsewhere may succeed."""

    http_status = 503
    error_type = "overloaded_error"


class WireFormatError(TandemError):
    """Bytes from another process do not decode to a valid message or frame."""

    http_status = 400
    error_type = "invalid_request_error"
