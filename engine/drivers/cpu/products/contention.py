"""How much of the machine other processes took while this one timed something: the CPU time
the whole machine spent busy (/proc/stat, steal included: another VM on the same host is a
neighbour too) less this process's own, over the wall time of every CPU.

A neighbour that keeps cores busy (a build, a CI job, a spinning loop) slows each timed run by
whatever share it takes, and a parallel kernel most, since each of its barriers waits for the
thread that was pushed off its core; the choice (choice.py) asks a challenger for a larger
lead over the path it would keep the busier the machine was while it timed them.
"""

from __future__ import annotations

import os
import time

MIN_WALL_S = 0.2


class Contention:
    """Started when made; `share()` is the share of all CPUs (0 to 1) others took since, or
    None where the machine does not say (no /proc/stat)."""

    def __init__(self):
        self._start = _sample()

    def share(self) -> float | None:
        end = _sample()
        if self._start is None or end is None:
            return None
        wall, busy, own = (b - a for a, b in zip(self._start, end, strict=True))
        if wall < MIN_WALL_S:  # the counters tick every 10 ms: too short to tell
            return None
        return min(max((busy - own) / (wall * (os.cpu_count() or 1)), 0.0), 1.0)


def _sample() -> tuple[float, float, float] | None:
    """(wall seconds, seconds the machine's CPUs were busy, this process's CPU seconds)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    tick = os.sysconf("SC_CLK_TCK")
    own = os.times()
    return time.monotonic(), (user + nice + system + irq + softirq + steal) / tick, own.user + own.system
