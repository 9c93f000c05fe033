"""The Starlette application: its routes, error handlers and lifespan.

Generation lives in generation.py, shared state in state.py, draining in draining.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from poot import __version__

from . import openai, responses
from .draining import CountActive, drain_watch
from .generation import generate, read_body
from .metrics import make_registry
from .openai import ApiError
from .state import ServerState

log = logging.getLogger("poot.server")

FAULT_KINDS = ("refuse", "fault", "panic")


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def build_app(state: ServerState):
    registry = make_registry(state)

    async def health(request: Request) -> Response:
        engine = state.engine
        if engine is None:
            return JSONResponse(state.loading_body(), status_code=503)
        h = engine.health()
        if h.status != "ok":
            return JSONResponse({"status": "dead", "cause": h.cause, "reason": h.reason}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining", "in_flight": engine.in_flight()}, status_code=503)
        return JSONResponse({"status": "ok", "version": __version__, "plan": engine.plan.as_dict()})

    async def models(request: Request) -> Response:
        engine = state.engine
        if engine is None:
            raise ApiError(503, "the model is still loading", code="loading")
        return JSONResponse({"object": "list", "data": [
            {"id": state.model.name, "object": "model", "created": state.created, "owned_by": "poot",
             "max_model_len": engine.plan.positions}]})

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def debug_fault(request: Request) -> Response:
        engine = state.engine
        if engine is None:
            raise ApiError(503, "the model is still loading", code="loading")
        body = openai.parse_body(await read_body(request))
        kind = body.get("kind")
        if kind not in FAULT_KINDS:
            raise openai.bad(f"kind must be one of {', '.join(FAULT_KINDS)}; got {kind!r}", "kind")
        engine.inject_fault(kind)
        log.warning("fault injected: %s", kind)
        return JSONResponse({"injected": kind})

    async def completions(request: Request) -> Response:
        state.requests["/v1/completions"] += 1
        return await generate(state, request, chat=False)

    async def chat_completions(request: Request) -> Response:
        state.requests["/v1/chat/completions"] += 1
        return await generate(state, request, chat=True)

    async def create_response(request: Request) -> Response:
        state.requests[responses.ENDPOINT] += 1
        return await responses.create(state, request)

    async def retrieve_response(request: Request) -> Response:
        return responses.retrieve(state, request.path_params["rid"])

    async def delete_response(request: Request) -> Response:
        return responses.delete(state, request.path_params["rid"])

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route(responses.ENDPOINT, create_response, methods=["POST"]),
        Route(responses.ENDPOINT + "/{rid}", retrieve_response, methods=["GET"]),
        Route(responses.ENDPOINT + "/{rid}", delete_response, methods=["DELETE"]),
    ]
    if state.fault_injection:
        routes.append(Route("/debug/fault", debug_fault, methods=["POST"]))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        threading.Thread(target=state.load, name="poot-load", daemon=True).start()
        watcher = asyncio.create_task(drain_watch(state))
        lag = asyncio.create_task(state.loop_lag.watch())
        yield
        watcher.cancel()
        lag.cancel()
        if state.engine is not None:
            await asyncio.to_thread(state.engine.stop, 2.0)

    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={ApiError: on_api_error, HTTPException: on_http_error, Exception: on_crash})
    return CountActive(app, state)


async def on_api_error(request: Request, exc: ApiError) -> Response:
    return error_response(exc)


async def on_http_error(request: Request, exc: HTTPException) -> Response:
    message = {404: f"no route for {request.method} {request.url.path}",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
    return error_response(ApiError(exc.status_code, message, code="not_found" if exc.status_code == 404 else None))


async def on_crash(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(ApiError(500, f"internal error: {type(exc).__name__}", code="internal_error"))
