"""Settings every test process shares, and the servers it starts inherit.

Tests run a server process beside the test process on a small machine; two BLAS thread
pools spinning against each other there slow both down many times over, so each process
uses one BLAS thread. Benchmarks (benchmarks/) run without this.
"""

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
