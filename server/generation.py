"""POST /v1/completions and /v1/chat/completions: a request into the engine, events back out.

Every request, plain or with n, best_of, echo or logprobs, takes one path: the engine runs one
sequence per choice (`Engine.submit_choices`: admitted together, the prompt prefilled once),
and calls each choice's sink on its own thread; the sink hands every event to the event loop
with `call_soon_threadsafe` into the choice's asyncio.Queue, so the handlers read events in
order without blocking the loop. server/answer.py shapes what they read.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from poot.engine import EngineDead, InvalidRequest
from poot.engine.events import Finished, PromptLogprobs, Rejected, Tokens

from . import loading, openai, tools
from .answer import Answer, ChoiceOutput, usage
from .event_stream import EventStream
from .openai import DONE, ApiError
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
    """One path for every generation request: a plain one is a request of one choice."""
    engine = state.serving_engine()
    parsed = parse(state, engine, openai.parse_body(await read_body(request)), chat)
    run = await start(state, engine, parsed)
    try:
        answer = Answer(parsed, state.model, openai.new_id(parsed.chat), state.model.name)
        if parsed.stream:
            return EventStream(stream(answer, run.queues, engine), run.cancel_all)
        return await collect(request, answer, run.queues, engine, run.cancel_all)
    except BaseException:
        run.cancel_all()
        raise


@dataclasses.dataclass(slots=True)
class Run:
    """A submitted request: its choices' handles, and the queues their events arrive on."""

    handles: list
    queues: list[asyncio.Queue]

    def cancel_all(self) -> None:  # a client that hangs up cancels every choice
        for h in self.handles:
            h.cancel()


async def start(state: ServerState, engine, parsed: openai.Parsed) -> Run:
    """Submits a parsed request (its grammars compiled first) and waits for the engine's
    verdict on it, so that a rejection is a 400 even for a stream: the one way into the
    engine for every endpoint."""
    params = parsed.params
    if parsed.choices.best_of > parsed.choices.n and params.logprobs is None:
        params = dataclasses.replace(params, logprobs=0)  # best_of ranks by summed logprob
    grammars = None
    constraint = parsed.response_format or parsed.tools
    if constraint is not None:
        # Compiled (or found compiled) off the event loop and off the engine thread, below the
        # engine's priority: a large schema takes a while, and no stream already running waits for it.
        try:
            grammars = await asyncio.wrap_future(state.compiling.submit(state.matchers, constraint,
                                                                        parsed.choices.count))
        except InvalidRequest as e:
            raise openai.bad(str(e), e.param) from None
    loop = asyncio.get_running_loop()
    queues: list[asyncio.Queue] = [asyncio.Queue() for _ in range(parsed.choices.count)]
    # The engine calls the sinks on its own thread; each hands its event to the event loop.
    sinks = [lambda ev, q=q: loop.call_soon_threadsafe(q.put_nowait, ev) for q in queues]
    try:
        run = Run(engine.submit_choices(parsed.prompt, params, sinks, grammars), queues)
    except InvalidRequest as e:
        raise openai.bad(str(e), e.param) from None
    except EngineDead as e:
        raise ApiError(503, f"the engine is not serving: {e}", code="engine_dead") from None
    try:
        for q in queues:  # headers wait for the engine's verdict
            first = await next_event(q, engine)
            if isinstance(first, Rejected):
                raise openai.bad(first.message, first.param)
            if isinstance(first, Finished):
                raise failure(engine, first)
    except BaseException:
        run.cancel_all()
        raise
    return run


def parse(state: ServerState, engine, body: dict, chat: bool) -> openai.Parsed:
    if not chat:
        return openai.parse_completion(body, state.model_names)
    use = tools.parse_tool_use(body)
    messages = tools.parse_tool_messages(openai.parse_messages(body), body["messages"])
    own = loading.template_renders_tools(state.model)
    try:
        prompt = loading.render_chat(state.model, tools.prompt_messages(messages, use, own),
                                     use.as_template_tools() if use is not None and own else None)
    except InvalidRequest as e:
        raise openai.bad(str(e), e.param or "messages") from None
    ids = state.model.encode_prompt(prompt)  # once: the engine takes the ids as they are
    return openai.parse_chat(body, state.model_names, ids, max(1, engine.plan.positions - len(ids)), use)


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


def failure(engine, ev: Finished) -> ApiError:
    """The error for a request that ended with reason error or cancelled."""
    if ev.reason == "cancelled":
        return ApiError(500, "the request was cancelled", code="cancelled")
    if engine.health().status != "ok":
        return ApiError(503, f"the request failed: {ev.error}", code="engine_dead")
    return ApiError(500, f"the request failed: {ev.error}", code="step_failed")


@contextlib.asynccontextmanager
async def hang_up_cancels(request: Request, cancel_all):
    """While the block runs, a client that hangs up before its whole answer cancels the
    request's choices at once (their rows are freed within a step)."""
    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        cancel_all()

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()


async def collect(request, answer: Answer, queues, engine, cancel_all) -> Response:
    """A whole answer: every choice's events until its Finished, while watching for a hang-up."""
    async def drain(out: ChoiceOutput, q: asyncio.Queue) -> None:
        if answer.echo_first(out):
            out.text.append(answer.prompt_text)
        while True:
            ev = await next_event(q, engine)
            if isinstance(ev, PromptLogprobs):
                answer.on_prompt(out, ev)
            elif isinstance(ev, Tokens):
                answer.on_tokens(out, ev)
            elif isinstance(ev, Finished):
                out.end = ev
                return

    async with hang_up_cancels(request, cancel_all):
        await asyncio.gather(*(drain(o, q) for o, q in zip(answer.outputs, queues, strict=True)))
    for o in answer.outputs:
        if o.end.reason not in ("stop", "length"):
            raise failure(engine, o.end)
    return JSONResponse(answer.full(usage(answer.outputs)))


async def stream(answer: Answer, queues, engine):
    """The SSE events of a stream: one chunk per committed step of each choice, then each
    choice's final chunk, the usage chunk when asked for, and [DONE]. A step whose text is
    held back (an incomplete character, a possible stop string, a control token with no
    text) still gets its chunk, with empty content, so a client can tell a stall from held text."""
    merged: asyncio.Queue = asyncio.Queue()

    async def forward(i: int, q: asyncio.Queue) -> None:
        while True:
            ev = await next_event(q, engine)
            merged.put_nowait((i, ev))
            if isinstance(ev, Finished):
                return

    tasks = [asyncio.create_task(forward(i, q)) for i, q in enumerate(queues)]
    try:
        for out in answer.outputs:
            if answer.p.chat:
                yield answer.choice_chunk(out.index, "", None, role=True)
            elif answer.echo_first(out):
                out.text.append(answer.prompt_text)
                yield answer.choice_chunk(out.index, answer.prompt_text, None)
        pending = len(queues)
        while pending:
            i, ev = await merged.get()
            out = answer.outputs[i]
            if isinstance(ev, PromptLogprobs):
                yield answer.choice_chunk(i, *answer.on_prompt(out, ev))
            elif isinstance(ev, Tokens):
                yield answer.choice_chunk(i, *answer.on_tokens(out, ev))
            elif isinstance(ev, Finished):
                pending -= 1
                out.end = ev
                if ev.reason not in ("stop", "length"):
                    yield openai.sse(failure(engine, ev).body())
                    yield DONE
                    return
                yield answer.choice_chunk(i, ev.text, None, ev.reason)
        if answer.p.include_usage:
            yield answer.usage_chunk()
        yield DONE
    finally:
        for t in tasks:
            t.cancel()
