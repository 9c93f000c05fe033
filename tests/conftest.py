"""Settings every test process shares, and the servers it starts inherit.

Tests run a server process beside the test process on a small machine; two BLAS thread
pools spinning against each other there slow both down many times over, so each process
uses one BLAS thread. Benchmarks (benchmarks/) run without this.
"""

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The deliberately broken servers (tests/poot_mutants) are imported as `poot_mutants`, as the
# servers the proof starts import them (with tests/ on PYTHONPATH).
sys.path.insert(0, str(Path(__file__).parent))


class _Quiet:
    def share(self):
        return 0.0


@pytest.fixture(autouse=True, scope="session")
def _private_product_choices(tmp_path_factory):
    """The CPU driver's product choices (engine/drivers/cpu/products/choice_cache.py) kept in a
    folder of this session's: a test never reads what another session measured. And timed as
    on a quiet machine, whatever else runs beside the tests (a busy one keeps the preferred
    paths untimed, choice.BUSY_LIMIT; tests that mean it say so). Servers the tests start
    keep theirs in the user's cache and watch the machine, as poot-serve does."""
    try:
        from poot.engine.drivers.cpu.products import choice, choice_cache
    except ImportError:  # the suite alone, without the engine's dependencies
        yield
        return
    folder = tmp_path_factory.mktemp("product-choices")
    real_root, real_watch = choice_cache.cache_root, choice.Contention
    choice_cache.cache_root, choice.Contention = (lambda: folder), _Quiet
    yield
    choice_cache.cache_root, choice.Contention = real_root, real_watch
