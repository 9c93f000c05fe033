"""The CPU driver on every instruction set this machine can compile for (engine/drivers/cpu/
target.py, POOT_CPU_ISA): the host's own, AVX2 without AVX-512, and the x86-64 baseline. numba
fixes its target per process, so each runs in a process of its own (isa_probe.py); an AVX-512
machine thus checks what a CPU without AVX-512 runs, and compares the two bit for bit.

- The integer products are the same bits on AVX2 as on AVX-512 VNNI (or as natively, on a
  host whose own instruction set is AVX2).
- The instruction set never changes the plan's rows or positions; the plan names it.
- MKL keeps to the mode's instruction sets too, or, where it will not be held (on CPUs that are
  not Intel's), the mode has no MKL products: never MKL code past the mode. The refusal is
  forced on any machine (POOT_PROBE_MKL=refuses), so an Intel machine checks the AMD answer.
- Without AVX2 the driver still serves, on the float paths.
- The integer path's own tests pass on AVX2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from poot.engine.drivers.cpu import target
from poot.engine.drivers.cpu.runtime import shared

from .harness import HALF_KV_RELATIVE

runtime = shared()
ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.skipif(not runtime.available(), reason=runtime.unavailable_reason()),
              pytest.mark.skipif(not all(f in target.host_features() for f in target.NEEDS["avx2"]),
                                 reason="this CPU cannot run AVX2 code")]
# The instruction sets' logits differ where the glue between products sums floats: each
# target vectorizes those sums at its own width (16 lanes or 8), so in another order.
ACROSS_TARGETS_RELATIVE = 1e-3


def _env(mode: str) -> dict[str, str]:
    return {**os.environ, target.VARIABLE: mode}


class Probes:
    """The probe processes, one per mode (and per forced MKL behaviour), each started once. The
    three modes' probes start together at the first one asked for: each is mostly numba
    compiling its mode's kernels on one thread, so on two cores the compiles overlap (in CI the
    avx2 and x86-64 modes compile from nothing: 52 and 74 s one after the other)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.running: dict[tuple[str, str], subprocess.Popen] = {}
        self.done: dict[tuple[str, str], dict[str, np.ndarray]] = {}

    def start(self, mode: str, forced: str = "") -> None:
        """`forced`: "refuses" runs the probe with MKL refusing every hold and on its generic
        code (a CPU it does not know), facts only."""
        key = (mode, forced)
        if key in self.running or key in self.done:
            return
        env = _env(mode) | ({"POOT_PROBE_MKL": forced, "MKL_CBWR": "COMPATIBLE"} if forced else {})
        self.running[key] = subprocess.Popen(
            [sys.executable, "-m", "tests.engine.isa_probe", str(self._out(key)), *(["--facts-only"] if forced else [])],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def __call__(self, mode: str, forced: str = "") -> dict[str, np.ndarray]:
        key = (mode, forced)
        if key not in self.done:
            if not forced:
                for each in target.CHOICES:
                    self.start(each)
            else:  # after the mode's own probe: its kernels are then in numba's cache
                self(mode)
                self.start(mode, forced)
            proc = self.running.pop(key)
            try:
                _, err = proc.communicate(timeout=1200)
            finally:
                proc.kill()
            assert proc.returncode == 0, err[-3000:]
            with np.load(self._out(key)) as data:
                arrays = {k: data[k] for k in data.files}
            arrays["facts"] = json.loads(str(arrays["facts"]))
            self.done[key] = arrays
        return self.done[key]

    def _out(self, key: tuple[str, str]) -> Path:
        mode, forced = key
        return self.folder / f"{mode}{'-' + forced if forced else ''}.npz"

    def close(self) -> None:
        for proc in self.running.values():
            proc.kill()
            proc.communicate()


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    probes = Probes(tmp_path_factory.mktemp("isa"))
    yield probes
    probes.close()


def _products(arrays: dict) -> list[str]:
    return sorted(k for k in arrays if "/" in k and not k.startswith("logits/"))


def _logits(arrays: dict) -> list[str]:
    return sorted(k for k in arrays if k.startswith("logits/"))


def test_the_integer_products_are_the_same_bits_on_avx2_as_natively(probe):
    native, avx2 = probe("native"), probe("avx2")
    assert avx2["facts"]["path"] == "avx2" and avx2["facts"]["isa"] == "avx2"
    assert native["facts"]["path"] is not None, "a host that runs AVX2 has an integer path natively"
    keys = _products(native)
    assert keys == _products(avx2) and len(keys) > 600
    differing = [k for k in keys if not np.array_equal(native[k], avx2[k])]
    assert not differing, f"{len(differing)} of {len(keys)} products differ, e.g. {differing[:5]}"


def test_no_instruction_set_changes_the_plans_rows_or_positions(probe):
    facts = {mode: probe(mode)["facts"] for mode in target.CHOICES}
    assert {(f["rows"], f["positions"]) for f in facts.values()} == {(facts["native"]["rows"], facts["native"]["positions"])}
    assert facts["avx2"]["num_blocks"] == facts["native"]["num_blocks"]
    assert facts["avx2"]["kv"] == facts["native"]["kv"] == "uint16" and facts["avx2"]["stack"]
    assert facts["native"]["isa"] == target.isa(target.host_features())
    assert facts["x86-64"]["isa"] == "x86-64"


# The code MKL may run in each held mode (platform/mkl.py's branch names).
WITHIN = {"x86-64": {"compatible", "sse2", "ssse3", "sse4_1", "sse4_2"}}
WITHIN["avx2"] = WITHIN["x86-64"] | {"avx", "avx2"}


def assert_mkl_keeps_to(mode: str, facts: dict) -> None:
    """The project's answer in a held mode, whichever MKL does: it runs within the mode's
    instruction sets, or it is out (with the reason), and then no product is offered MKL,
    so no choice, measured or kept, can name it, and steps are not padded for it."""
    if facts["mkl"] is not None:
        assert facts["mkl"] in WITHIN[mode], (mode, facts["mkl"])
        assert "mkl" in facts["offered"]
        return
    assert "MKL refused to keep to " + mode in facts["mkl_reason"] or "MKL kept to" in facts["mkl_reason"], facts
    assert "mkl" not in facts["offered"] and facts["token_multiple"] == 1, facts


def test_mkl_keeps_to_the_instruction_sets_of_the_mode(probe):
    """MKL picks its code by the CPU, not by numba's target: held to AVX2, an AVX-512 host
    would otherwise time (and serve) MKL's products on AVX-512 (its GEMM there ran 1.6x faster).
    On Intel's CPUs MKL is held (AVX2 and SSE4.2 code); on AMD's it refuses, and is left out."""
    from poot.engine.drivers.cpu.platform import mkl

    facts = {mode: probe(mode)["facts"] for mode in target.CHOICES}
    assert facts["native"]["mkl"] is not None, facts["native"]["mkl_reason"]  # the wheel is a test dependency
    assert facts["native"]["mkl"] in mkl.BRANCHES.values(), facts["native"]["mkl"]
    for mode in ("avx2", "x86-64"):
        assert_mkl_keeps_to(mode, facts[mode])
    order = list(mkl.BRANCHES.values())
    if "+avx512f" in target.host_features() and facts["native"]["mkl"] != "auto":  # Intel's
        assert order.index(facts["native"]["mkl"]) > order.index("avx2"), facts["native"]["mkl"]


def test_an_mkl_that_refuses_to_be_held_is_left_out_of_the_held_mode(probe):
    """What an AMD CPU does, forced on this one: MKL refuses to keep to AVX2 (and runs its
    generic code, MKL_CBWR=COMPATIBLE). Held to AVX2 the driver then has no MKL products and
    says why; natively it still offers MKL, on the code MKL named, for the choice to measure."""
    held, native = probe("avx2", "refuses")["facts"], probe("native", "refuses")["facts"]
    assert held["mkl"] is None and "MKL refused to keep to avx2" in held["mkl_reason"], held
    assert_mkl_keeps_to("avx2", held)
    assert held["path"] == "avx2" and "avx2" in held["offered"] and "openblas" in held["offered"]
    assert native["mkl"] == "compatible" and "mkl" in native["offered"], native


def test_avx2s_logits_are_the_native_ones_to_float_rounding(probe):
    native, avx2 = probe("native"), probe("avx2")
    for key in _logits(native):
        scale = np.abs(native[key]).max()
        np.testing.assert_allclose(avx2[key], native[key], rtol=0, atol=ACROSS_TARGETS_RELATIVE * scale, err_msg=key)


def test_a_cpu_without_avx2_serves_on_the_float_paths(probe):
    """No integer path, no float16 KV (nothing to widen it with), the same logits to the float
    paths' and the KV cache's rounding."""
    native, baseline = probe("native"), probe("x86-64")
    assert baseline["facts"]["path"] is None and baseline["facts"]["kv"] == "float32"
    assert not _products(baseline) and _logits(baseline) == _logits(native)
    for key in _logits(native):
        scale = np.abs(native[key]).max()
        np.testing.assert_allclose(baseline[key], native[key], rtol=0, atol=HALF_KV_RELATIVE * scale, err_msg=key)


def test_the_integer_paths_own_tests_pass_on_avx2():
    files = ["tests/engine/test_block_products.py", "tests/engine/test_decoder_stack.py",
             "tests/engine/test_int8_codegen.py"]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *files], cwd=ROOT,
                          env=_env("avx2"), capture_output=True, text=True, timeout=1800)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-2000:]
    assert done.returncode == 0, done.stdout[-4000:]
    # Only the VNNI tile's checks may skip there; everything on the integer path must run.
    skipped = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED")]
    assert all("AVX-512 VNNI" in line for line in skipped), skipped
    assert " passed" in summary, summary


@pytest.mark.realmodel
@pytest.mark.slow
def test_smollm2_greedy_continuations_on_avx2_match_float32():
    """SmolLM2's 64 prompts of tests/models/test_block_codes.py on the AVX2 integer path: logits
    within the same tolerance of the float32 path, and the greedy continuations as close."""
    test = "tests/models/test_block_codes.py::test_smollm2_decode_on_codes_matches_float32"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-rs", test], cwd=ROOT,
                          env=_env("avx2"), capture_output=True, text=True, timeout=1800)
    if "SKIPPED" in done.stdout and done.returncode == 0:
        pytest.skip(next(line for line in done.stdout.splitlines() if line.startswith("SKIPPED")))
    assert done.returncode == 0, done.stdout[-4000:]
    assert "agree; worst relative logit difference" in done.stdout, done.stdout[-2000:]
