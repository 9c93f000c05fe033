"""poot-serve's console while it starts (server/start_line.py): one line rewritten in place on
a terminal, with whatever else is written going above it; plain log lines elsewhere."""

from __future__ import annotations

import io
import logging
import os
import pty
import select
import subprocess
import time

from poot.engine.progress import Progress
from poot.server.start_line import CLEAR, StartLine

from .proc import EXE


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_on_a_terminal_the_line_is_redrawn_in_place_below_other_writes():
    screen = io.StringIO()
    line = StartLine(screen, interactive=True)
    log = line.share(screen)
    progress = Progress()
    line.follow(progress)
    progress.report("compile", "compiling CPU kernels", 0, 4)
    log.write("INFO: a log line\n")
    progress.finish()
    out = screen.getvalue()
    assert "\n" not in out.split("INFO: a log line")[0], "the line itself never ends a line"
    draws = out.split(CLEAR)
    assert any(d.startswith("poot-serve: starting (0 s) compile: compiling CPU kernels (1 of 4) 0%") for d in draws)
    # The log line is written over the erased line, and the line drawn again after it.
    after = out.index("INFO: a log line\n")
    assert out[:after].endswith(CLEAR) and out[after:].split(CLEAR)[1].startswith("poot-serve: starting")
    assert out.endswith("poot-serve: ready after 0.0 s\n")
    log.write("later\n")
    assert screen.getvalue().endswith("ready after 0.0 s\nlater\n"), "nothing is drawn once the start is over"


def test_elsewhere_one_log_line_per_phase_and_at_most_one_every_two_seconds(caplog):
    clock = Clock()
    line = StartLine(io.StringIO(), interactive=False, clock=clock)
    progress = Progress(clock=clock)
    with caplog.at_level(logging.INFO, logger="poot.server"):
        line.follow(progress)
        for i in range(5):
            progress.report("model", "dequantizing", i, 5)
            clock.t += 0.6
        progress.report("compile", "preparing")
        progress.finish()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["starting (0 s): model: starting",
                     "starting (2 s): model: dequantizing (5 of 5) 80%",
                     "starting (3 s): compile: preparing",
                     "ready after 3.0 s"], lines
    stream = io.StringIO()
    assert line.share(stream) is stream, "nothing to share where no line is drawn"


def test_poot_serve_on_a_terminal_draws_the_line_and_says_when_it_is_ready():
    main, other = pty.openpty()
    proc = subprocess.Popen([EXE, "--model", "synthetic", "--port", "0"], stdin=subprocess.DEVNULL,
                            stdout=other, stderr=other, env={**os.environ, "TERM": "xterm"})
    os.close(other)
    out = b""
    deadline = time.monotonic() + 120
    try:
        while b"ready after" not in out and time.monotonic() < deadline:
            if select.select([main], [], [], 1)[0]:
                try:
                    out += os.read(main, 65536)
                except OSError:
                    break
    finally:
        proc.terminate()
        proc.wait(30)
        os.close(main)
    text = out.decode(errors="replace")
    assert "poot-serve: starting (" in text and CLEAR in text, text
    assert "poot-serve: ready after" in text, text
    assert "Uvicorn running on" in text, text


def test_a_good_start_on_the_cpu_prints_no_error_and_one_line_on_the_backend_probe():
    """Without XDG_RUNTIME_DIR (a service, a container, CI), listing WebGPU adapters loads Mesa's
    drivers, whose display lookup printed "error: XDG_RUNTIME_DIR is invalid or not set" four
    times before the model loaded. `auto` now says what it found in one line, and nothing else
    (here, with no GPU device file, it lists no adapters at all; with one, it lists them quietly:
    tests/drivers/test_wgpu_driver.py)."""
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    proc = subprocess.Popen([EXE, "--model", "synthetic", "--port", "0"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    lines: list[str] = []
    deadline = time.monotonic() + 180
    try:
        while time.monotonic() < deadline:
            line = proc.stdout.readline().decode(errors="replace")
            if not line:
                break
            lines.append(line.rstrip("\n"))
            if "ready after" in line:
                break
    finally:
        proc.terminate()
        proc.wait(30)
    text = "\n".join(lines)
    assert "Uvicorn running on" in text and "ready after" in text, text
    assert not [line for line in lines if "error" in line.lower()], text
    probe = [line for line in lines if "backend auto:" in line]
    assert len(probe) == 1 and probe[0].endswith(": numpy, the CPU"), text
