"""Threads for work that must yield the CPU to the engine: compiling grammars.

A grammar compiles in llguidance's native code, with the GIL released, for up to a second or
two. On a machine with as many busy cores as the engine uses, a compile at the same priority
takes a core from the engine's step threads, and a step that waits for its slowest thread then
runs several times its usual length: every stream's next token waits. At a lower priority the
compile runs in the time the engine leaves (it still runs: the engine waits between steps and
for the event loop), and the request being compiled waits instead of the streams already
running.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

NICE = 10  # raised from the process's own; Linux's weights give such a thread about a tenth of a busy core


def yielding_pool(workers: int, name: str) -> ThreadPoolExecutor:
    """A pool whose threads run at a lower CPU priority than the rest of the process."""
    return ThreadPoolExecutor(workers, thread_name_prefix=name, initializer=lower_priority)


def lower_priority() -> None:
    """Lowers the calling thread's priority where the OS allows one thread's to be set (Linux
    schedules threads as tasks, each with its own nice value); elsewhere leaves it."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + NICE)
