"""Turns committed tokens into streamable text, and finds stop strings across token edges.

Text that could still become a stop string is held back, never streamed, so the streamed
text is exactly the text a non-streaming request gets. An incomplete UTF-8 character (the
decoder shows it as U+FFFD) is held back until its last byte arrives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class StopChecker:
    def __init__(self, decode: Callable[[Sequence[int]], str], stops: Sequence[str]):
        self.decode = decode
        self.stops = tuple(stops)
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters of self.text already released

    def add(self, token_id: int) -> tuple[str, bool]:
        """Adds one token; returns (text now safe to stream, whether a stop string ended it)."""
        self.ids.append(token_id)
        self.text = self.decode(self.ids)
        hit = self._first_stop()
        if hit is not None:
            released = self.text[self.sent : hit] if hit > self.sent else ""
            self.sent = max(self.sent, hit)
            self.text = self.text[:hit]
            return released, True
        safe = len(self.text) - self.held_back()
        released = self.text[self.sent : safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return released, False

    def flush(self) -> str:
        """Releases what was held back once the request ends without a stop string."""
        released = self.text[self.sent :]
        self.sent = len(self.text)
        return released

    def final_text(self) -> str:
        return self.text[: self.sent]

    def _first_stop(self) -> int | None:
        # Only text not yet released can hold a new match, plus a stop's length of overlap.
        longest = max((len(s) for s in self.stops), default=0)
        window = max(0, self.sent - longest)
        found = [i for s in self.stops if (i := self.text.find(s, window)) >= 0]
        return min(found) if found else None

    def held_back(self) -> int:
        # An incomplete character may still complete a stop string begun before it, so the
        # stop-prefix test runs on the text before it and both parts are held.
        complete = self.text.rstrip("\ufffd")
        partial = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(complete)), 0, -1):
                if complete.endswith(stop[:n]):
                    partial = max(partial, n)
                    break
        return len(self.text) - len(complete) + partial
