"""Incremental Server-Sent Events parsing and the per-request stream recorder.

Transport-agnostic: feed bytes as they arrive (from requests, httpx or a socket) and the
recorder timestamps every OpenAI chunk that carries output text, and after the first one every
step's chunk whose text the server held back (it sends the chunk with empty content): a
stream's gaps are then the server's step cadence, not the text's (a control token or half a
character would otherwise show as a gap of two steps). The clock is injectable so tests can
replay recorded timelines.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator


class SseParser:
    """Splits a byte stream into SSE `data:` payloads (one string per event)."""

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> Iterator[str]:
        self._buf += chunk
        while True:
            # Lines end with \n, \r\n or \r; normalising \r\n first keeps offsets simple.
            idx = self._buf.find(b"\n")
            if idx < 0:
                return
            line, self._buf = self._buf[:idx], self._buf[idx + 1:]
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if self._data:
                    payload = "\n".join(self._data)
                    self._data = []
                    yield payload
                continue
            if line.startswith(b":"):
                continue  # comment / keep-alive
            field, _, value = line.partition(b":")
            if value.startswith(b" "):
                value = value[1:]
            if field == b"data":
                self._data.append(value.decode("utf-8", errors="replace"))

    def close(self) -> Iterator[str]:
        """Flushes an event left without its terminating blank line."""
        if self._buf:
            yield from self.feed(b"\n")
        if self._data:
            payload = "\n".join(self._data)
            self._data = []
            yield payload


def chunk_text(obj: dict) -> tuple[str, str | None]:
    """(text, finish_reason) of one completions or chat-completions chunk."""
    text, finish = "", None
    for choice in obj.get("choices") or []:
        if "text" in choice:
            text += choice.get("text") or ""
        delta = choice.get("delta") or {}
        text += delta.get("content") or ""
        if choice.get("finish_reason"):
            finish = choice["finish_reason"]
    return text, finish


def is_step_chunk(obj: dict) -> bool:
    """Whether a chunk is one step's output, text or not: a choice with a text field or a
    content delta, no role (the chat stream's opening chunk) and no finish reason (the
    closing chunk)."""
    choices = obj.get("choices") or []
    if not choices:
        return False
    for choice in choices:
        if choice.get("finish_reason"):
            return False
        delta = choice.get("delta")
        if "text" not in choice and not (isinstance(delta, dict) and "content" in delta and "role" not in delta):
            return False
    return True


class StreamRecorder:
    """Records one streamed request: chunk arrival offsets, usage, finish reason, errors."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, t_sent: float | None = None):
        self.clock = clock
        self.t_sent = clock() if t_sent is None else t_sent
        self.parser = SseParser()
        self.chunks: list[float] = []
        self.chunk_chars: list[int] = []
        self.events = 0
        self.empty_chunks = 0
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.timings: dict = {}  # the server's own split of the wait, where it sends one
        self.done = False
        self.error: str | None = None
        self.text_parts: list[str] = []
        self.keep_text = False
        self.end: float | None = None

    def feed(self, data: bytes) -> None:
        now = self.clock() - self.t_sent
        for payload in self.parser.feed(data):
            self._event(payload, now)

    def finish(self) -> None:
        now = self.clock() - self.t_sent
        for payload in self.parser.close():
            self._event(payload, now)
        self.end = now

    def _event(self, payload: str, now: float) -> None:
        self.events += 1
        if payload.strip() == "[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(payload)
        except ValueError:
            self.error = f"bad SSE payload: {payload[:60]!r}"
            return
        if isinstance(obj, dict) and "error" in obj:
            err = obj["error"]
            self.error = (err.get("message") if isinstance(err, dict) else str(err)) or "error event"
            return
        text, finish = chunk_text(obj)
        if text or (self.chunks and is_step_chunk(obj)):
            self.chunks.append(now)
            self.chunk_chars.append(len(text))
            if self.keep_text:
                self.text_parts.append(text)
        elif obj.get("choices"):
            self.empty_chunks += 1
        if finish:
            self.finish_reason = finish
        if obj.get("usage"):
            self.usage = obj["usage"]
        if isinstance(obj.get("timings"), dict):
            self.timings = obj["timings"]

    def record(self) -> dict:
        usage = self.usage or {}
        details = usage.get("prompt_tokens_details") or {}
        return {
            "chunks": self.chunks,
            "chunk_chars": self.chunk_chars,
            "empty_chunks": self.empty_chunks,
            "end": self.end,
            "finish_reason": self.finish_reason,
            "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens"),
            "cached_tokens": details.get("cached_tokens"),
            # Server side: poot-serve's queued_ms and prefill_ms; llama.cpp's server names its
            # prompt processing prompt_ms and reports no queue time.
            "queued_ms": self.timings.get("queued_ms"),
            "prefill_ms": self.timings.get("prefill_ms", self.timings.get("prompt_ms")),
            "done": self.done,
        }
