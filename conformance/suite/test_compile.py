"""compile/*: batch changes compile nothing after the first request."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from poot.conformance.client import Client
from poot.conformance.scenarios import Mux, Probes, fill_rows, unique_text

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
        with ThreadPoolExecutor(count) as pool:
            list(pool.map(lambda i, c=chars, m=max_tokens: client.complete(unique_text(c + 5 * i), **probes.long_params(m + i)),
                          range(count)))
    # Every row at once: the streams wait until all `rows` run in the same steps.
    full = fill_rows(client, probes, rows, [48 + i for i in range(rows)], prompt_chars=12)
    try:
        Mux(full).run(timeout=60)
    finally:
        for s in full:
            s.close()
    client.wait_idle()
    after = client.metric("engine_compiles")
    assert after == before, f"engine_compiles went from {before:.0f} to {after:.0f} as the batch changed"
