"""compile/*: batch changes compile nothing after the first request."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from poot.conformance.client import Client
from poot.conformance.scenarios import Probes, fill_rows, unique_text

clause = pytest.mark.clause


@clause("compile/constant/1")
def test_batch_changes_compile_nothing(client: Client, probes: Probes, idle):
    """Batches of every size up to the plan's full row capacity: a server that builds an
    entry per batch-size bucket, lazily, compiles when a bucket is first used."""
    rows = client.need("rows")["rows"]
    client.complete("warm up", max_tokens=4)
    before = client.metric("engine_compiles")
    shapes = [(1, 20, 8), (2, 40, 16), (3, 300, 4), (rows // 2 + 1, 64, 40), (1, 8, 1)]
    for count, chars, max_tokens in shapes:
        # prompts and lengths vary within each batch, by at most 16 steps whatever the rows
        with ThreadPoolExecutor(count) as pool:
            list(pool.map(lambda i, c=chars, m=max_tokens: client.complete(unique_text(c + 5 * (i % 16)),
                                                                           **probes.long_params(m + i % 16)),
                          range(count)))
    # Every row at once. The fillers are long, so the first still runs when the last opens
    # however slowly they open; the engine takes a few steps with all of them, then they hang up.
    positions = client.need("rows", "positions")["positions"]
    full = fill_rows(client, probes, rows, [positions - 40 - i for i in range(rows)], prompt_chars=12)
    try:
        steps_with_every_row(client, rows)
    finally:
        for s in full:
            s.close()
    client.wait_idle()
    after = client.metric("engine_compiles")
    assert after == before, f"engine_compiles went from {before:.0f} to {after:.0f} as the batch changed"


def steps_with_every_row(client: Client, rows: int, steps: int = 3) -> None:
    """Returns once the engine has taken `steps` steps with `rows` requests running throughout
    (a second where the server counts no steps)."""
    if client.facts is not None and not client.facts.has("steps"):
        time.sleep(1.0)
    else:
        start = client.metric("engine_steps_total")
        client.wait_until(lambda s: s.get("engine_steps_total", 0) >= start + steps, 20, f"{steps} engine steps")
    running = client.metric("engine_requests_running")
    assert running >= rows, f"only {running:.0f} of {rows} requests still ran once the batch was full"
