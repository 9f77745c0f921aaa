"""Tandem's error hierarchy: each error carries the request id (if any) and maps to one HTTP status.

The router maps these to the OpenAI error shape once, at its edge; engines and planes raise them.
"""

from __future__ import annotations


class TandemError(Exception):
    """Base of every error Tandem raises on purpose."""

    http_status = 500
    error_type = "server_error"

    def __init__(
        self,
        message: str,
        *,
        request_id: str | None = None,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.request_id = request_id
        self.param = param
        self.code = code  # a machine-readable reason beside the type (OpenAI's `code`)
        self.retry_after = retry_after  # seconds a client should wait before it tries again

    def __str__(self) -> str:
        prefix = f"[{self.request_id}] " if self.request_id else ""
        return prefix + self.message


class Stopped(Exception):
    """A service was asked to stop (SIGTERM, SIGINT) before it was up: not an error."""


class InvalidRequestError(TandemError):
    """The request itself is wrong (empty prompt, bad parameter, too long)."""

    http_status = 400
    error_type = "invalid_request_error"


class AuthenticationError(TandemError):
    """No API key, or one the router does not know."""

    http_status = 401
    error_type = "authentication_error"


class NotFoundError(TandemError):
    """What the request names does not exist (a model, a request to resume)."""

    http_status = 404
    error_type = "invalid_request_error"


class ConflictError(TandemError):
    """The request collides with work in progress (a stream another router serves)."""

    http_status = 409
    error_type = "invalid_request_error"


class PayloadTooLargeError(TandemError):
    """The request body is larger than the router accepts."""

    http_status = 413
    error_type = "invalid_request_error"


class RequestTimeoutError(TandemError):
    """The client did not send its whole request body within the router's deadline."""

    http_status = 408
    error_type = "invalid_request_error"


class RateLimitError(TandemError):
    """Too many requests in flight (router-wide or for one API key): retry shortly."""

    http_status = 429
    error_type = "rate_limit_error"


class GenerationError(TandemError):
    """A node failed while generating the request's tokens."""

    http_status = 503
    error_type = "overloaded_error"


class DeadlineError(TandemError):
    """The request ran out of time (first token, a stalled stream, the whole request)."""

    http_status = 504
    error_type = "timeout_error"


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
