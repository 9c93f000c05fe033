import sys
from pathlib import Path

# Lets the benchmarks reuse the tests' engine harness.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
