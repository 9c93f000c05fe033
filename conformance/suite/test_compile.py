"""compile/*: batch changes compile nothing after the first request."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from poot.conformance.client import Client
from poot.conformance.scenarios import Probes, unique_text

clause = pytest.mark.clause


@clause("compile/constant/1")
def test_batch_changes_compile_nothing(client: Client, probes: Probes, idle):
    client.complete("warm up", max_tokens=4)
    before = client.metric("engine_compiles")
    rows = min((client.facts.get("rows") if client.facts else None) or 8, 12)
    shapes = [(1, 20, 8), (2, 40, 16), (rows, 12, 24), (3, 300, 4), (rows // 2 + 1, 64, 40), (1, 8, 1)]
    for count, chars, max_tokens in shapes:
        with ThreadPoolExecutor(count) as pool:
            list(pool.map(lambda i, c=chars, m=max_tokens: client.complete(unique_text(c + 5 * i), **probes.long_params(m + i)),
                          range(count)))
    after = client.metric("engine_compiles")
    assert after == before, f"engine_compiles went from {before:.0f} to {after:.0f} as the batch changed"
