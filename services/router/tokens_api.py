"""vLLM's extension endpoints that tools probe: `POST /tokenize`, `POST /detokenize`,
`GET /version`. Same shapes as vLLM's (`count`, `max_model_len`, `tokens`; `prompt`;
`version`), validated like the completions body, answered by the tokenizer of the model
the body names (the router's first model when it names none, as vLLM lets it).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from aiohttp import web

from services.router.admission import off_loop, read_body
from services.router.inflight import InFlight
from services.router.validation import Limits, tokenize_body
from shared.errors import InvalidRequestError, NotFoundError
from shared.model.tokenizer import TokenizerInfo


def _version() -> str:
    try:
        return importlib.metadata.version("tandem")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "unknown"


VERSION = _version()
T = TypeVar("T")


class TokensApi:
    def __init__(
        self,
        tokenizers: Mapping[str, TokenizerInfo],
        limits: Limits,
        max_body_bytes: int,
        body_timeout: float,
        inflight: InFlight,
    ) -> None:
        self.tokenizers = tokenizers
        # The tokenising thread is the completions' too: a call waiting for it counts
        # against --max-inflight as a request does, so /tokenize cannot queue without bound
        # ahead of them.
        self.inflight = inflight
        self.limits = limits
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout

    async def _body(self, request: web.Request) -> tuple[dict[str, Any], TokenizerInfo]:
        body = await read_body(request, self.max_body_bytes, self.body_timeout)
        if not isinstance(body, dict):
            raise InvalidRequestError("request body must be a JSON object")
        model = body.get("model", next(iter(self.tokenizers)))  # vLLM lets it be left out
        tok = self.tokenizers.get(model) if isinstance(model, str) else None
        if tok is None:
            raise NotFoundError(f"model '{model}' not found", param="model", code="model_not_found")
        return body, tok

    async def _on_thread(self, request: web.Request, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the tokenising thread in the turn of the request's key, counted
        in flight (429 when full)."""
        self.inflight.check_room()
        with self.inflight.admit():
            return await off_loop(request, fn, *args)

    async def tokenize(self, request: web.Request) -> web.Response:
        body, tok = await self._body(request)
        tokens = await self._on_thread(request, tokenize_body, body, tok)
        return web.json_response(
            {"count": len(tokens), "max_model_len": tok.max_model_len, "tokens": tokens}
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        body, tok = await self._body(request)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens
        ):
            raise InvalidRequestError("'tokens' must be a list of token ids", param="tokens")
        if any(not 0 <= t < tok.vocab_size for t in tokens):
            raise InvalidRequestError("'tokens' holds ids outside the vocabulary", param="tokens")
        return web.json_response({"prompt": await self._on_thread(request, tok.decode, tokens)})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": VERSION})
