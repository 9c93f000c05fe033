"""Settings every test process shares, and the servers it starts inherit.

Tests run a server process beside the test process on a small machine; two BLAS thread
pools spinning against each other there slow both down many times over, so each process
uses one BLAS thread. Benchmarks (benchmarks/) run without this.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The deliberately broken servers (tests/poot_mutants) are imported as `poot_mutants`, as the
# servers the proof starts import them (with tests/ on PYTHONPATH).
sys.path.insert(0, str(Path(__file__).parent))
