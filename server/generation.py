"""POST /v1/completions and /v1/chat/completions: a request into the engine, events back out.

The engine calls each request's sink on its own thread; the sink hands every event to the
event loop with `call_soon_threadsafe` into the request's asyncio.Queue, so the handlers read
events in order without blocking the loop.
"""

from __future__ import annotations

import asyncio
import contextlib

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from poot.engine import EngineDead, InvalidRequest
from poot.engine.events import Accepted, Finished, Rejected, Tokens

from . import choices, loading, openai
from .event_stream import EventStream
from .openai import DONE, ApiError, ChunkMaker
from .state import ServerState

DEAD_POLL_S = 1.0  # how often a waiting handler re-checks that the engine still lives


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


async def generate(state: ServerState, request: Request, chat: bool) -> Response:
    engine = state.serving_engine()
    body = openai.parse_body(await read_body(request))
    parsed = parse(state, engine, body, chat)
    if not parsed.choices.plain:  # n, best_of, echo or logprobs: one sequence per choice
        return await choices.serve(state, request, parsed, engine)
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def sink(event) -> None:  # engine thread
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
            chunks = ChunkMaker(parsed, rid, name)
            return EventStream(stream(parsed, queue, engine, chunks), handle.cancel)
        return await collect(request, parsed, handle, queue, engine, rid, name)
    except BaseException:
        handle.cancel()
        raise


def parse(state: ServerState, engine, body: dict, chat: bool) -> openai.Parsed:
    if not chat:
        return openai.parse_completion(body, state.model_names)
    messages = openai.parse_messages(body)
    try:
        prompt = loading.render_chat(state.model, messages)
    except InvalidRequest as e:
        raise openai.bad(str(e), e.param or "messages") from None
    room = engine.plan.positions - len(state.model.encode_prompt(prompt))
    return openai.parse_chat(body, state.model_names, prompt, max(1, room))


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


def usage_of(ev: Finished) -> dict:
    return openai.usage(ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens)


async def collect(request, parsed, handle, queue, engine, rid, name) -> Response:
    """A non-streaming answer: every event until Finished, while watching for a hang-up."""
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
        watcher.cancel()
    if ev.reason not in ("stop", "length"):
        raise failure(engine, ev)
    parts.append(ev.text)
    return JSONResponse(openai.full_response(parsed, rid, name, "".join(parts), ev.reason, usage_of(ev),
                                             openai.timings(ev.queued_s, ev.prefill_s)))


async def stream(parsed, queue, engine, chunks: ChunkMaker):
    """The SSE events of a stream: one per committed step, then the final chunk and [DONE].
    A step whose text is held back (an incomplete character, a possible stop string, a
    control token with no text) still gets its chunk, with empty content: the stream shows
    every step's token as it is committed, so a client can tell a stall from held text."""
    if parsed.chat:
        yield chunks.role()
    while True:
        ev = await next_event(queue, engine)
        if isinstance(ev, Tokens):
            yield chunks.text(ev.text)
        elif isinstance(ev, Finished):
            if ev.reason in ("stop", "length"):
                yield chunks.text(ev.text, ev.reason)
                if parsed.include_usage:
                    yield chunks.usage(usage_of(ev), openai.timings(ev.queued_s, ev.prefill_s))
            else:
                yield openai.sse(failure(engine, ev).body())
            yield DONE
            return
