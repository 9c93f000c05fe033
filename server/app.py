"""The Starlette application: OpenAI-compatible generation, health, metrics and fault injection.

The engine calls each request's sink on its own thread; the sink hands every event to the
event loop with `call_soon_threadsafe` into the request's asyncio.Queue, so the handlers read
events in order without blocking the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import sys
import threading
import time

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from poot.engine import EngineDead, InvalidRequest
from poot.engine.events import Accepted, Finished, Rejected, Tokens

from . import loading, openai
from .metrics import make_registry
from .openai import DONE, ApiError, ChunkMaker

log = logging.getLogger("poot.server")

FAULT_KINDS = ("refuse", "fault", "panic")
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")
DEAD_POLL_S = 1.0  # how often a waiting handler re-checks that the engine still lives


class ServerState:
    """Everything the routes share. `engine` is None until the model has loaded."""

    def __init__(self, model_spec: str | None = None, backend: str = "auto", draft: str | None = None,
                 engine_mutations: frozenset[str] = frozenset(), mutations: frozenset[str] = frozenset(),
                 fault_injection: bool = False, step_delay: float = 0.0):
        self.model_spec = model_spec
        self.backend = backend
        self.draft = draft
        self.engine_mutations = engine_mutations
        self.mutations = mutations  # server-level mutations (see mutations.py)
        self.fault_injection = fault_injection
        self.step_delay = step_delay
        self.engine = None
        self.model = None
        self.model_names: tuple[str, ...] = ()
        self.created = int(time.time())
        self.draining = False
        self.active = 0  # generation requests the app has not finished answering
        self.exit_code = 0
        self.request_exit = lambda: None  # set by the CLI: makes uvicorn shut down

    # ---- loading (runs on its own thread while the server already answers /health) ----

    def load(self) -> None:
        from poot.engine import Engine
        from poot.engine.models.base import ModelLoadError

        try:
            model = loading.load_model(self.model_spec)
            driver = None
            if self.step_delay > 0 or "rows_from_env" in self.mutations:
                from poot.engine.drivers import make_driver

                driver = make_driver(self.backend, self.engine_mutations)
                if self.step_delay > 0:
                    slowed(driver, self.step_delay)
                if "rows_from_env" in self.mutations and os.environ.get("POOT_ROWS", "").isdigit():
                    rows_from_env(driver, int(os.environ["POOT_ROWS"]))
            engine = Engine.create(model, backend=self.backend, draft=self.draft,
                                   mutations=self.engine_mutations, driver=driver)
            engine.start()
        except ModelLoadError as e:
            self.fatal(f"poot-serve: cannot load the model: {e}")
        except Exception as e:  # a plan that does not fit, a driver that cannot start, ...
            self.fatal(f"poot-serve: cannot start the engine: {type(e).__name__}: {e}")
        else:
            self.model = model
            names = [model.name]
            if self.model_spec and self.model_spec != model.name:
                names.append(self.model_spec)
            self.model_names = tuple(names)
            self.engine = engine  # last: from here on the server is ready
            log.info("ready: model %s, plan %s", model.name, engine.plan.as_dict())

    def fatal(self, line: str) -> None:
        print(line.replace("\n", " "), file=sys.stderr, flush=True)
        self.exit_code = 1
        self.request_exit()

    # ---- availability -----------------------------------------------------------------

    def serving_engine(self):
        engine = self.engine
        if engine is None:
            raise ApiError(503, "the model is still loading", code="loading")
        h = engine.health()
        if h.status != "ok":
            raise ApiError(503, f"the engine is dead ({h.cause}): {h.reason}", code="engine_dead")
        if self.draining and not {"healthy_while_draining", "serve_while_draining"} & self.mutations:
            raise ApiError(503, "the server is shutting down and takes no new requests", code="draining")
        return engine


def slowed(driver, delay: float):
    """Test-only (--step-delay): the driver sleeps before each step, so steps are slow enough to
    watch. Only `step` is wrapped: the device the plan is fitted to is the driver's own, so
    rows, positions and blocks are the same as without it."""
    step = driver.step

    def slow_step(batch):
        time.sleep(delay)
        return step(batch)

    driver.step = slow_step
    return driver


def rows_from_env(driver, rows: int):
    """The rows_from_env mutation: the device reports POOT_ROWS parallel rows, so the plan follows."""
    device = driver.device

    def patched():
        return dataclasses.replace(device(), parallel_rows=rows)

    driver.device = patched
    return driver


# ---- helpers -------------------------------------------------------------------------------

def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def read_body(request: Request) -> bytes:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > openai.MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is larger than {openai.MAX_BODY_BYTES} bytes", None, "body_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > openai.MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is larger than {openai.MAX_BODY_BYTES} bytes", None,
                           "body_too_large")
    return bytes(body)


async def next_event(queue: asyncio.Queue, engine):
    """The next event of a request; a synthetic error Finished if the engine died without one."""
    with contextlib.suppress(asyncio.QueueEmpty):
        return queue.get_nowait()
    while True:
        try:
            return await asyncio.wait_for(queue.get(), DEAD_POLL_S)
        except TimeoutError:
            h = engine.health()
            if h.status != "ok" and queue.empty():
                return Finished("error", 0, 0, 0, f"engine {h.cause}: {h.reason}")


async def watch_disconnect(receive, handle) -> None:
    """Cancels the request as soon as its client hangs up (the body has been read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            handle.cancel()
            return


def failure(engine, ev: Finished) -> ApiError:
    """The error for a request that ended with reason error or cancelled."""
    if ev.reason == "cancelled":
        return ApiError(500, "the request was cancelled", code="cancelled")
    if engine.health().status != "ok":
        return ApiError(503, f"the request failed: {ev.error}", code="engine_dead")
    return ApiError(500, f"the request failed: {ev.error}", code="step_failed")


# ---- the application -------------------------------------------------------------------------

def build_app(state: ServerState) -> Starlette:
    muts = state.mutations
    registry = make_registry(state)

    async def health(request: Request) -> Response:
        engine = state.engine
        if engine is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        h = engine.health()
        if h.status != "ok" and "healthy_when_dead" not in muts:
            cause = "fault" if "panic_reported_as_fault" in muts and h.cause == "panicked" else h.cause
            return JSONResponse({"status": "dead", "cause": cause, "reason": h.reason}, status_code=503)
        if state.draining and "healthy_while_draining" not in muts:
            return JSONResponse({"status": "draining", "in_flight": engine.in_flight()}, status_code=503)
        status = "ready" if "health_status_ready" in muts else "ok"
        return JSONResponse({"status": status, "plan": engine.plan.as_dict()})

    async def models(request: Request) -> Response:
        engine = state.engine
        if engine is None:
            raise ApiError(503, "the model is still loading", code="loading")
        return JSONResponse({"object": "models" if "models_not_a_list" in muts else "list", "data": [
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
        return await generate(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    async def generate(request: Request, chat: bool) -> Response:
        engine = state.serving_engine()
        body = openai.parse_body(await read_body(request), objects_only="non_object_body_500" not in muts)
        if not isinstance(body, dict):  # only under the non_object_body_500 mutation
            raise ApiError(500, "internal error: the request body is not an object", code="internal_error")
        if "no_token_prompts" in muts and not chat and isinstance(body.get("prompt"), list):
            raise openai.bad("prompt must be a string", "prompt")
        try:
            parsed = parse(engine, body, chat)
        except ApiError as e:
            if "bad_params_500" in muts and e.status == 400 and e.param in SAMPLING_FIELDS:
                raise ApiError(500, e.message, e.param) from None
            raise
        if not parsed.choices.plain:  # n, best_of, echo or logprobs: one sequence per choice
            from . import choices

            return await choices.serve(state, request, parsed, engine)

        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def sink(event) -> None:  # engine thread
            if "stop_reported_as_length" in muts and isinstance(event, Finished) and event.reason == "stop":
                event = dataclasses.replace(event, reason="length")
            loop.call_soon_threadsafe(queue.put_nowait, event)

        try:
            handle = engine.submit(parsed.prompt, parsed.params, sink)
        except InvalidRequest as e:
            raise openai.bad(str(e), e.param) from None
        except EngineDead as e:
            raise ApiError(503, f"the engine is not serving: {e}", code="engine_dead") from None
        try:
            # Headers wait for the engine's verdict, so a rejection is a 400 even when streaming.
            first = await next_event(queue, engine)
            if isinstance(first, Rejected):
                raise openai.bad(first.message, first.param)
            if isinstance(first, Finished):
                raise failure(engine, first)
            assert isinstance(first, Accepted), first
            rid = openai.new_id(chat)
            name = state.model.name
            if parsed.stream:
                chunks = ChunkMaker(parsed, rid, name, same_id="chunk_ids_differ" not in muts)
                on_close = None if "ignore_disconnect_stream" in muts else handle.cancel
                return EventStream(stream(parsed, queue, engine, chunks), on_close)
            return await collect(request, parsed, handle, queue, engine, rid, name)
        except BaseException:
            handle.cancel()
            raise

    def parse(engine, body: dict, chat: bool) -> openai.Parsed:
        if not chat:
            return openai.parse_completion(body, state.model_names)
        messages = openai.parse_messages(body)
        try:
            prompt = loading.render_chat(state.model, messages)
        except InvalidRequest as e:
            raise openai.bad(str(e), e.param or "messages") from None
        room = engine.plan.positions - len(state.model.encode_prompt(prompt))
        return openai.parse_chat(body, state.model_names, prompt, max(1, room))

    async def collect(request, parsed, handle, queue, engine, rid, name) -> Response:
        watcher = None
        if "ignore_disconnect_nonstream" not in muts:
            watcher = asyncio.create_task(watch_disconnect(request.receive, handle))
        parts = []
        try:
            while True:
                ev = await next_event(queue, engine)
                if isinstance(ev, Tokens):
                    parts.append(ev.text)
                elif isinstance(ev, Finished):
                    break
        finally:
            if watcher is not None:
                watcher.cancel()
        if ev.reason not in ("stop", "length"):
            raise failure(engine, ev)
        parts.append(ev.text)
        answer = openai.full_response(parsed, rid, name, "".join(parts), ev.reason, usage_of(ev))
        if "completion_no_created" in muts and not parsed.chat:
            del answer["created"]
        if "chat_no_role" in muts and parsed.chat:
            del answer["choices"][0]["message"]["role"]
        return JSONResponse(answer)

    def usage_of(ev: Finished) -> dict:
        use = openai.usage(ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens)
        if "total_without_prompt" in muts:
            use["total_tokens"] = ev.completion_tokens
        return use

    async def stream(parsed, queue, engine, chunks: ChunkMaker):
        leak = "stream_stop_prefix" in muts
        batch = "batch_stream" in muts
        decode = state.model.tokenizer.decode
        ids: list[int] = []
        leaked = 0  # characters already sent by the stream_stop_prefix mutation
        held: list[str] = []  # text kept for the final chunk by the batch_stream mutation
        drop_first = "stream_drops_first_text" in muts
        if parsed.chat:
            yield chunks.role()
        while True:
            ev = await next_event(queue, engine)
            if isinstance(ev, Tokens):
                text = ev.text
                if leak:  # decode at once, ignoring what the engine holds back
                    ids.extend(ev.token_ids)
                    full = decode(ids).rstrip("\ufffd")
                    text, leaked = full[leaked:], max(leaked, len(full))
                if drop_first and text:
                    text, drop_first = "", False
                if batch:
                    held.append(text)
                elif text:
                    yield chunks.text(text)  # one event per committed step
            elif isinstance(ev, Finished):
                if ev.reason in ("stop", "length"):
                    tail = "" if leak else ev.text
                    yield chunks.text("".join(held) + tail, ev.reason)
                    if parsed.include_usage and "ignore_include_usage" not in muts:
                        yield chunks.usage(usage_of(ev))
                else:
                    yield openai.sse(failure(engine, ev).body())
                if "no_done_sentinel" not in muts:
                    yield DONE
                return

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]
    if state.fault_injection:
        routes.append(Route("/debug/fault", debug_fault, methods=["POST"]))

    async def on_api_error(request: Request, exc: ApiError) -> Response:
        if "error_param_null" in muts and exc.status == 400:
            exc.param = None
        if "dead_plain_503" in muts and exc.code == "engine_dead":
            return Response(exc.message, status_code=503, media_type="text/plain")
        return error_response(exc)

    async def on_http_error(request: Request, exc: HTTPException) -> Response:
        if "unknown_path_400" in muts and exc.status_code == 404:
            return error_response(ApiError(400, f"bad request for {request.url.path}"))
        message = {404: f"no route for {request.method} {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
        return error_response(ApiError(exc.status_code, message, code="not_found" if exc.status_code == 404 else None))

    async def on_crash(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(ApiError(500, f"internal error: {type(exc).__name__}", code="internal_error"))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        threading.Thread(target=state.load, name="poot-load", daemon=True).start()
        watcher = asyncio.create_task(drain_watch(state))
        yield
        watcher.cancel()
        if state.engine is not None:
            await asyncio.to_thread(state.engine.stop, 2.0)

    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={ApiError: on_api_error, HTTPException: on_http_error, Exception: on_crash})
    return CountActive(app, state)


class EventStream(StreamingResponse):
    """An SSE response that cancels its request however the response ends.

    A task awaits `receive()` beside the sending, and the moment it sees `http.disconnect` it
    cancels the engine request (before anything else is unwound), so a client that hangs up is
    released at the engine's next iteration rather than whenever a send notices. An error or the
    normal end cancels too (a no-op: the request is finished already). `on_close` None (the
    ignore_disconnect_stream mutation) listens for nothing: the request runs to its end."""

    def __init__(self, events, on_close):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        if self.on_close is None:
            with contextlib.suppress(OSError):  # sends after a hang-up are dropped; the stream runs on
                await self.stream_response(send)
            return

        async def hang_up() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            self.on_close()  # at once: the engine releases the request at its next iteration

        sending = asyncio.ensure_future(self.stream_response(send))
        watching = asyncio.ensure_future(hang_up())
        try:
            await asyncio.wait((sending, watching), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.on_close()
            for task in (sending, watching):
                task.cancel()
            await asyncio.gather(sending, watching, return_exceptions=True)
        if sending.done() and not sending.cancelled() and isinstance(sending.exception(), Exception):
            if not isinstance(sending.exception(), OSError):  # OSError: the client is gone
                raise sending.exception()


async def drain_watch(state: ServerState) -> None:
    """Once draining and nothing is in flight (engine or HTTP), lets uvicorn shut down."""
    while True:
        await asyncio.sleep(0.02)
        if not state.draining:
            continue
        engine = state.engine
        if (engine is None or engine.in_flight() == 0) and state.active == 0:
            log.info("drained: shutting down")
            if "drain_exit_1" in state.mutations:
                state.exit_code = 1
            state.request_exit()
            return


class CountActive:
    """ASGI wrapper counting generation requests until their response (stream included) ends."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/") and scope["method"] == "POST":
            self.state.active += 1
            try:
                await self.app(scope, receive, send)
            finally:
                self.state.active -= 1
        else:
            await self.app(scope, receive, send)
