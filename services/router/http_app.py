"""The router's HTTP application: routes, the OpenAI error shape for every failure, API keys.

Middlewares run outermost first: `errors` turns any TandemError (including the 401/429 that
`auth` raises) and aiohttp's own HTTP errors into the OpenAI error body (errors.py).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from services.router.app import Router
from services.router.auth import ApiKeys, auth_middleware
from services.router.errors import error_response, from_http_exception
from shared.errors import TandemError


def build_app(router: Router, keys: ApiKeys | None = None) -> web.Application:
    @web.middleware
    async def errors(request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            resp: web.StreamResponse = await handler(request)
            return resp
        except TandemError as exc:
            return error_response(exc)
        except web.HTTPException as exc:
            if exc.status >= 400:
                return error_response(from_http_exception(exc))
            raise

    def rejected(status: str) -> None:
        router.parts.metrics.errors.labels(status).inc()

    # errors first: it turns the TandemError that auth raises into the OpenAI error shape.
    authenticate = auth_middleware(keys or ApiKeys([]), rejected)
    app = web.Application(
        client_max_size=router.parts.config.max_body_bytes, middlewares=[errors, authenticate]
    )
    app.router.add_post("/v1/completions", router.completions)
    app.router.add_post("/v1/chat/completions", router.chat_completions)
    app.router.add_get("/v1/models", router.models)
    app.router.add_get("/v1/requests/{request_id}/stream", router.resume)
    app.router.add_post("/tokenize", router.tokens.tokenize)
    app.router.add_post("/detokenize", router.tokens.detokenize)
    app.router.add_get("/version", router.tokens.version)
    app.router.add_get("/healthz", router.healthz)
    app.router.add_get("/readyz", router.readyz)
    app.router.add_get("/metrics", router.metrics_endpoint)
    return app
