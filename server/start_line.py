"""poot-serve's console while it starts: what the start is doing and how far it has got.

On a terminal, one line at the bottom, rewritten in place as the start moves on and every
second (its clock); whatever else is written to the terminal meanwhile (uvicorn's and the
server's log lines, the access log) goes above it: the console's streams are shared with the
line (`SharedStream`), which clears itself before another write and draws itself again
after it. Elsewhere (a log file, a CI job) the start is logged as plain lines instead: one
per phase, and at most one every LOG_EVERY_S seconds within a phase.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
import time

from poot.engine.progress import Progress, Stage

log = logging.getLogger("poot.server")

LOG_EVERY_S = 2.0
TICK_S = 1.0
CLEAR = "\r\x1b[K"  # back to the line's start, and erase it


def describe(stage: Stage) -> str:
    fraction = "" if stage.fraction is None else f" {stage.fraction:.0%}"
    return f"{stage.phase}: {stage.detail}{fraction}"


class StartLine:
    """The console's account of one start. `interactive`: a terminal to draw on (default:
    whether the stream is one)."""

    def __init__(self, stream=None, interactive: bool | None = None, clock=time.monotonic):
        self.stream = stream if stream is not None else sys.stderr
        if interactive is None:
            interactive = is_terminal(self.stream)
        self.interactive = interactive
        self.clock = clock
        self.lock = threading.RLock()
        self.progress: Progress | None = None
        self.shown = False  # the line is on the screen now
        self._logged: tuple[str, float] | None = None  # (phase, when) of the last log line

    def share(self, stream):
        """`stream`, written through the line on a terminal (so that writes go above it)."""
        return SharedStream(stream, self) if self.interactive else stream

    def follow(self, progress: Progress) -> None:
        """Shows `progress` from now until it finishes."""
        self.progress = progress
        progress.listen(self.update)
        if self.interactive:
            threading.Thread(target=self._tick, name="poot-start-line", daemon=True).start()
        self.update(progress.now)

    def update(self, stage: Stage) -> None:
        progress = self.progress
        if progress is None:
            return
        if self.interactive:
            with self.lock:
                if progress.finished is not None:
                    self.clear()
                    if progress.finished == "ready":
                        self.stream.write(f"poot-serve: ready after {progress.elapsed():.1f} s\n")
                        self.stream.flush()
                else:
                    self.draw()
            return
        if progress.finished == "ready":
            log.info("ready after %.1f s", progress.elapsed())
        elif progress.finished is None:
            now = self.clock()
            if self._logged is None or self._logged[0] != stage.phase or now - self._logged[1] >= LOG_EVERY_S:
                self._logged = (stage.phase, now)
                log.info("starting (%.0f s): %s", progress.elapsed(), describe(stage))

    def text(self) -> str:
        progress = self.progress
        return f"poot-serve: starting ({progress.elapsed():.0f} s) {describe(progress.now)}"

    def draw(self) -> None:
        """Writes the line over whatever line is there (with the lock held)."""
        if self.progress is None or self.progress.finished is not None:
            return
        width = shutil.get_terminal_size((80, 24)).columns
        self.stream.write(CLEAR + self.text()[: max(width - 1, 10)])
        self.stream.flush()
        self.shown = True

    def clear(self) -> None:
        """Erases the line, if it is on the screen (with the lock held)."""
        if self.shown:
            self.stream.write(CLEAR)
            self.stream.flush()
            self.shown = False

    def _tick(self) -> None:
        while self.progress.finished is None:
            time.sleep(TICK_S)
            with self.lock:
                self.draw()


class SharedStream:
    """A console stream shared with the start line: a write first clears the line, and once
    it has ended a line of its own, the start line is drawn again below it."""

    def __init__(self, stream, line: StartLine):
        self._stream = stream
        self._line = line

    def write(self, text: str) -> int:
        with self._line.lock:
            self._line.clear()
            n = self._stream.write(text)
            if text.endswith("\n"):
                self._stream.flush()
                self._line.draw()
            return n

    def __getattr__(self, name):  # flush, fileno, isatty, encoding, ...: the stream's own
        return getattr(self._stream, name)


def is_terminal(stream) -> bool:
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False
