"""Answers a generation request that asks for more than one plain choice: n choices, best_of,
echo, logprobs. The engine runs one sequence per choice (`Engine.submit_choices`: admitted
together, the prompt prefilled once); this module reads their events and builds the
OpenAI answer, streamed with each choice's own index or whole. A client that hangs up
cancels every choice.

best_of runs best_of sequences and answers the n whose tokens have the highest summed
logprob; usage counts the tokens of every sequence that ran.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field

from starlette.responses import JSONResponse, Response

from poot.engine import EngineDead, InvalidRequest
from poot.engine.events import Finished, PromptLogprobs, Rejected, Tokens

from . import openai
from .event_stream import EventStream
from .logprobs_shape import CompletionLogprobs, TokenTexts, chat_content, merge_completion
from .openai import DONE, ApiError, Parsed


@dataclass(slots=True)
class ChoiceOutput:
    """What one choice has produced so far."""

    index: int
    logprobs: CompletionLogprobs
    text: list[str] = field(default_factory=list)
    completion_parts: list[dict] = field(default_factory=list)
    chat_parts: list[dict] = field(default_factory=list)
    score: float = 0.0  # summed logprob of the generated tokens (best_of)
    end: Finished | None = None


class Answer:
    """Shapes events of one request's choices as completions or chat choices."""

    def __init__(self, parsed: Parsed, model, rid: str, name: str):
        self.p, self.rid, self.name = parsed, rid, name
        self.created = int(time.time())
        self.texts = TokenTexts(model.tokenizer)
        prompt = parsed.prompt
        self.prompt_text = prompt if isinstance(prompt, str) else model.tokenizer.decode(prompt)
        self.outputs = [ChoiceOutput(i, CompletionLogprobs(self.texts)) for i in range(parsed.choices.count)]

    @property
    def wants_logprobs(self) -> bool:
        return self.p.choices.logprobs is not None

    def on_prompt(self, out: ChoiceOutput, ev: PromptLogprobs) -> tuple[str, dict | None]:
        out.text.append(self.prompt_text)
        lp = out.logprobs.shape(ev.token_ids, ev.logprobs, ev.top_logprobs) if self.wants_logprobs else None
        if lp is not None:
            out.completion_parts.append(lp)
        return self.prompt_text, lp

    def on_tokens(self, out: ChoiceOutput, ev: Tokens) -> tuple[str, dict | None]:
        out.text.append(ev.text)
        out.score += sum(ev.logprobs)
        if not self.wants_logprobs:
            return ev.text, None
        if self.p.chat:
            part = {"content": chat_content(self.texts, ev.token_ids, ev.logprobs, ev.top_logprobs)}
            out.chat_parts.extend(part["content"])
        else:
            part = out.logprobs.shape(ev.token_ids, ev.logprobs, ev.top_logprobs)
            out.completion_parts.append(part)
        return ev.text, part

    def echo_first(self, out: ChoiceOutput) -> bool:
        """Echo without logprobs: the prompt's text goes first, no scores to wait for."""
        return self.p.choices.echo and self.p.params.prompt_logprobs is None

    # ---- whole answers ----

    def full(self, use: dict) -> dict:
        outs = [o for o in self.outputs if o.end is not None]
        if self.p.choices.best_of > self.p.choices.n:
            outs = sorted(outs, key=lambda o: -o.score)[: self.p.choices.n]
        choices = []
        for i, o in enumerate(outs):
            text = "".join(o.text) + o.end.text
            if self.p.chat:
                lp = {"content": o.chat_parts} if self.wants_logprobs else None
                choices.append({"index": i, "message": {"role": "assistant", "content": text},
                                "logprobs": lp, "finish_reason": o.end.reason})
            else:
                lp = merge_completion(o.completion_parts) if self.wants_logprobs else None
                if lp is None and self.wants_logprobs:
                    lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
                choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": o.end.reason})
        return {"id": self.rid, "object": "chat.completion" if self.p.chat else "text_completion",
                "created": self.created, "model": self.name, "choices": choices, "usage": use}

    # ---- stream chunks ----

    def chunk(self, choices: list, use: dict | None = None, with_usage: bool = False) -> str:
        obj = {"id": self.rid, "object": "chat.completion.chunk" if self.p.chat else "text_completion",
               "created": self.created, "model": self.name, "choices": choices}
        if self.p.include_usage or with_usage:
            obj["usage"] = use
        return openai.sse(obj)

    def choice_chunk(self, index: int, text: str, lp: dict | None, finish_reason: str | None = None,
                     role: bool = False) -> str:
        if self.p.chat:
            delta = ({"role": "assistant", "content": ""} if role
                     else {"content": text} if text or finish_reason is None else {})
            return self.chunk([{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}])
        return self.chunk([{"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}])


def usage(outputs: list[ChoiceOutput]) -> dict:
    ends = [o.end for o in outputs if o.end is not None]
    return openai.usage(ends[0].prompt_tokens, sum(e.completion_tokens for e in ends), ends[0].cached_tokens)


async def serve(state, request, parsed: Parsed, engine) -> Response:
    from .generation import failure, next_event  # generation hands plain requests on here: import late

    count = parsed.choices.count
    params = parsed.params
    if parsed.choices.best_of > parsed.choices.n and params.logprobs is None:
        params = dataclasses.replace(params, logprobs=0)  # best_of ranks by summed logprob
    loop = asyncio.get_running_loop()
    queues: list[asyncio.Queue] = [asyncio.Queue() for _ in range(count)]
    sinks = [lambda ev, q=q: loop.call_soon_threadsafe(q.put_nowait, ev) for q in queues]
    try:
        handles = engine.submit_choices(parsed.prompt, params, sinks)
    except InvalidRequest as e:
        raise openai.bad(str(e), e.param) from None
    except EngineDead as e:
        raise ApiError(503, f"the engine is not serving: {e}", code="engine_dead") from None

    def cancel_all() -> None:
        for h in handles:
            h.cancel()

    try:
        for q in queues:  # headers wait for the engine's verdict on every choice
            first = await next_event(q, engine)
            if isinstance(first, Rejected):
                raise openai.bad(first.message, first.param)
            if isinstance(first, Finished):
                raise failure(engine, first)
        answer = Answer(parsed, state.model, openai.new_id(parsed.chat), state.model.name)
        if parsed.stream:
            return EventStream(stream(answer, queues, engine, next_event, failure), cancel_all)
        return await collect(request, answer, queues, engine, next_event, failure, cancel_all)
    except BaseException:
        cancel_all()
        raise


async def collect(request, answer: Answer, queues, engine, next_event, failure, cancel_all) -> Response:
    async def hang_up() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        cancel_all()

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

    watcher = asyncio.create_task(hang_up())
    try:
        await asyncio.gather(*(drain(o, q) for o, q in zip(answer.outputs, queues, strict=True)))
    finally:
        watcher.cancel()
    for o in answer.outputs:
        if o.end.reason not in ("stop", "length"):
            raise failure(engine, o.end)
    return JSONResponse(answer.full(usage(answer.outputs)))


async def stream(answer: Answer, queues, engine, next_event, failure):
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
                text, lp = answer.on_prompt(out, ev)
                yield answer.choice_chunk(i, text, lp)
            elif isinstance(ev, Tokens):
                text, lp = answer.on_tokens(out, ev)
                yield answer.choice_chunk(i, text, lp)  # held-back text too: one chunk per step
            elif isinstance(ev, Finished):
                pending -= 1
                out.end = ev
                if ev.reason not in ("stop", "length"):
                    yield openai.sse(failure(engine, ev).body())
                    yield DONE
                    return
                yield answer.choice_chunk(i, ev.text, None, ev.reason)
        if answer.p.include_usage:
            yield answer.chunk([], usage(answer.outputs), with_usage=True)
        yield DONE
    finally:
        for t in tasks:
            t.cancel()
