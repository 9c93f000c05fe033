"""The OpenAI answer of one generation request, built from its choices' events: whole, or as
stream chunks under each choice's own index. Shaping only; server/generation.py reads the
events. A plain request is one choice; n, best_of, echo and logprobs shape the same answer.

best_of runs best_of sequences and answers the n whose tokens have the highest summed
logprob; usage counts the tokens of every sequence that ran. `timings` (where the time to
first token went) is the first choice's: a request's choices are admitted together and
their prompt prefilled once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from poot.engine.events import Finished, PromptLogprobs, Tokens

from . import openai
from .logprobs_shape import CompletionLogprobs, TokenTexts, chat_content, merge_completion
from .openai import Parsed
from .tools import CallReader


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
        # A chat that may call tools: each streamed choice's text read as it comes (server/tools.py).
        self.readers = [CallReader() for _ in self.outputs] if parsed.tools is not None else None

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
                message, reason = self.message(text, o.end.reason)
                choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": reason})
            else:
                lp = merge_completion(o.completion_parts) if self.wants_logprobs else None
                if lp is None and self.wants_logprobs:
                    lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
                choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": o.end.reason})
        return {"id": self.rid, "object": "chat.completion" if self.p.chat else "text_completion",
                "created": self.created, "model": self.name, "choices": choices, "usage": use,
                "timings": self.timings()}

    def message(self, text: str, reason: str) -> tuple[dict, str]:
        """A whole chat choice's message and finish_reason: its text, or the tool calls it
        made (finish_reason tool_calls). A call cut short by max_tokens stays text."""
        if self.readers is None:
            return {"role": "assistant", "content": text}, reason
        reader = CallReader()
        reader.feed(text)
        if reader.mode == "calls" and reader.made_calls:
            return ({"role": "assistant", "content": None, "tool_calls": [c.as_dict() for c in reader.calls]},
                    "tool_calls" if reason == "stop" else reason)
        return {"role": "assistant", "content": text}, reason

    def timings(self) -> dict:
        end = self.outputs[0].end
        return openai.timings(end.queued_s, end.prefill_s)

    # ---- stream chunks ----

    def chunk(self, choices: list) -> str:
        obj = {"id": self.rid, "object": "chat.completion.chunk" if self.p.chat else "text_completion",
               "created": self.created, "model": self.name, "choices": choices}
        if self.p.include_usage:
            obj["usage"] = None  # every chunk carries the field; only the last one its value
        return openai.sse(obj)

    def usage_chunk(self) -> str:
        return openai.sse({"id": self.rid, "object": "chat.completion.chunk" if self.p.chat else "text_completion",
                           "created": self.created, "model": self.name, "choices": [],
                           "usage": usage(self.outputs), "timings": self.timings()})

    def choice_chunk(self, index: int, text: str, lp: dict | None, finish_reason: str | None = None,
                     role: bool = False) -> str:
        if self.p.chat:
            if role:
                delta = {"role": "assistant", "content": ""}
            elif self.readers is not None:
                delta, finish_reason = self.tool_delta(index, text, finish_reason)
            else:
                delta = {"content": text} if text or finish_reason is None else {}
            return self.chunk([{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}])
        return self.chunk([{"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}])


    def tool_delta(self, index: int, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """A streamed step of a chat that may call tools: content, or tool_calls entries
        (each call's first with its index, id and name, then its arguments in pieces)."""
        reader = self.readers[index]
        content, calls = reader.feed(text)
        if finish_reason is not None:
            content += reader.finish()
            if finish_reason == "stop" and reader.made_calls:
                finish_reason = "tool_calls"
        delta: dict = {}
        if content or (not calls and finish_reason is None and reader.mode != "calls"):
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta, finish_reason


def usage(outputs: list[ChoiceOutput]) -> dict:
    ends = [o.end for o in outputs if o.end is not None]
    return openai.usage(ends[0].prompt_tokens, sum(e.completion_tokens for e in ends), ends[0].cached_tokens)
