"""server/background.py: the threads a grammar's long compile runs on yield to the engine."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from poot.server.background import NICE, yielding_pool


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="one thread's priority is set on Linux only")
def test_a_yielding_thread_runs_below_the_process_and_leaves_the_caller_as_it_was():
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with yielding_pool(1, "test-yielding") as pool:
        theirs = pool.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result()
    assert theirs == min(mine + NICE, 19)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
