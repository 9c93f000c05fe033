"""The CuPy driver's host half, on every run and without a device: the kernels' argument
checks, the 16-bit packing, the plan from a device's figures, how device errors map to the
loop's two failures, and start-up where CuPy, cuBLAS or a device is missing."""

from __future__ import annotations

import numpy as np
import pytest

from poot.engine.drivers import cupy_device, make_driver
from poot.engine.drivers.base import DeviceFault, RowWork, StepPlan, StepRefused
from poot.engine.drivers.cuda import reference as ref
from poot.engine.drivers.cupy_device import NoDevice, Probe
from poot.engine.drivers.cupy_driver import CupyDriver, half_words
from poot.engine.drivers.cupy_launch import ReferenceLauncher, signatures
from poot.engine.models.base import LlamaConfig
from poot.engine.models.synthetic import synthetic_llama
from poot.engine.plan import BLOCK_SIZE, KV_SHARE, fit_plan

from .cupy_steps import H200, cuda_device, pair


def test_the_reference_launcher_refuses_arguments_the_kernel_would_misread():
    k = ReferenceLauncher("f16")
    x, h = np.zeros((4, 8), np.float32), np.zeros((4, 8), np.float16)
    k.rms_norm(x, h, 4, 8, 1e-5)
    with pytest.raises(TypeError, match="argument 1"):
        k.rms_norm(x, h.astype(np.float32), 4, 8, 1e-5)  # h must be W
    with pytest.raises(TypeError, match="wants float32"):
        k.launch("rms_norm_f16", (4,), (256,), (x, h, np.int32(8), 1e-5))  # a Python float is a double
    with pytest.raises(TypeError, match="5 arguments for 4 parameters"):
        k.launch("rms_norm_f16", (4,), (256,), (x, h, np.int32(8), np.float32(1e-5), np.int32(0)))
    with pytest.raises(ValueError, match="launch bounds"):
        k.launch("rms_norm_f16", (4,), (128,), (x, h, np.int32(8), np.float32(1e-5)))


def test_the_signatures_read_are_the_compiled_entry_points():
    """What the reference launcher checks arguments against is every entry point the
    sources define, and each kernel a launcher names is in the compiled PTX."""
    from poot.engine.drivers.cuda import compile as cc

    assert set(signatures()) == set(cc.kernel_names())
    pytest.importorskip("cuda.bindings.nvrtc", reason="NVRTC (the ptx extra) is not installed")
    ptx = "".join(unit.ptx for unit in cc.compile_all().values())
    for wtype in ("f16", "bf16"):
        assert all(f".entry {name}(" in ptx for name in ReferenceLauncher(wtype).names())


# ---- 16-bit words -----------------------------------------------------------------------------------


def test_half_words_fp16_round_trips_and_bf16_rounds_to_nearest_even():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((7, 5)).astype(np.float32)
    words, kind = half_words(w)
    assert kind == "f16" and words.dtype == np.uint16 and words.shape == w.shape
    np.testing.assert_array_equal(words.view(np.float16), w.astype(np.float16))
    exact = w.astype(np.float16).astype(np.float32)  # fp16 values come back bit for bit
    np.testing.assert_array_equal(half_words(exact)[0].view(np.float16).astype(np.float32), exact)
    assert half_words(np.array([65504.0, -1.0], np.float32))[1] == "f16"  # fp16's largest still fits
    assert half_words(np.array([-65519.0], np.float32))[1] == "f16"  # rounds down to 65504
    assert half_words(np.array([65520.0], np.float32))[1] == "bf16"  # rounds to inf in fp16
    big = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, 7e4, -3e38], np.float32)
    words, kind = half_words(big)
    assert kind == "bf16"
    assert words[:3].tolist() == [0x3F80, 0x3F80, 0x3F82]  # ties go to the even word
    back = ref.bf16_to_f32(words)
    np.testing.assert_allclose(back, big, rtol=2**-8)
    exact = back.copy()
    np.testing.assert_array_equal(ref.bf16_to_f32(half_words(exact, "bf16")[0]), exact)  # bf16 values exact
    assert half_words(np.array([np.inf, np.nan, 3.0], np.float32))[1] == "f16"  # non-finite values are kept as they are
    words, kind = half_words(w, "bf16")
    assert kind == "bf16"
    np.testing.assert_allclose(ref.bf16_to_f32(words), w, rtol=2**-8)


# ---- the plan from the device's figures ---------------------------------------------------------


def test_device_info_from_the_probe():
    info = cupy_device.device_info(H200, "ptx")
    assert info.backend == "ptx" and info.name == "NVIDIA H200"
    assert info.memory_bytes == int(141_000_000_000 * 0.9)
    assert info.parallel_rows == 256  # 2 x 132 SMs = 264, down to a multiple of 32
    assert info.flops_per_byte == 200.0
    assert cupy_device.parallel_rows(16) == 32 and cupy_device.parallel_rows(300) == 512
    assert cupy_device.device_info(H200, "ptx", memory_bytes=1 << 30).memory_bytes == 1 << 30


def test_the_plan_on_an_h200():
    """The synthetic model: every row at full length fits, so the blocks are rows x blocks
    per sequence. An 8B Llama (fp16 weights, 128 KiB of KV a token): the KV share of what the
    weights leave sets the blocks."""
    driver = CupyDriver("ptx", xp=np, kernels=ReferenceLauncher, probe=H200)
    model = synthetic_llama(0)
    plan = fit_plan(driver.device(), model.config, driver.weight_bytes(model), model.name,
                    kv_bytes_per_token=driver.kv_bytes_per_token(model.config))
    assert (plan.rows, plan.positions, plan.num_blocks) == (256, 512, 256 * 512 // BLOCK_SIZE)

    big = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                      num_kv_heads=8, head_dim=128, max_positions=8192, tie_embeddings=False)
    weights = 2 * big.weight_count() + 4 * 2048 * 128
    kv_token = driver.kv_bytes_per_token(big)
    assert kv_token == 2 * 32 * 8 * 128 * 2
    plan = fit_plan(driver.device(), big, weights, "8b", kv_bytes_per_token=kv_token)
    blocks = int((int(141e9 * 0.9) - weights) * KV_SHARE) // (BLOCK_SIZE * kv_token)
    assert (plan.rows, plan.positions, plan.num_blocks) == (256, 2048, blocks)
    assert 10_000 < blocks < 256 * 2048 // BLOCK_SIZE  # memory, not the rows, sets it


class FakeHipRuntime:
    """What probe() reads of CuPy for ROCm on an MI250X (gfx90a, 64-lane wavefronts)."""

    is_hip = True

    @staticmethod
    def getDeviceCount():  # noqa: N802 (CuPy's name)
        return 1

    @staticmethod
    def getDeviceProperties(device):  # noqa: N802
        return {"name": b"AMD Instinct MI250X", "multiProcessorCount": 110, "major": 9, "minor": 0, "warpSize": 64,
                "gcnArchName": b"gfx90a:sramecc+:xnack-"}

    @staticmethod
    def memGetInfo():  # noqa: N802
        return 60 << 30, 64 << 30


def fake_cupy(runtime):
    import contextlib
    import types

    cuda = types.SimpleNamespace(runtime=runtime, Device=lambda i=0: contextlib.nullcontext())
    return types.SimpleNamespace(cuda=cuda)


def test_a_rocm_device_is_probed_with_its_wavefront_and_architecture(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "cupy", fake_cupy(FakeHipRuntime))
    found = cupy_device.probe("rocm")
    assert (found.hip, found.lanes, found.arch, found.multiprocessors) == (True, 64, "gfx90a:sramecc+:xnack-", 110)
    info = cupy_device.device_info(found, "rocm")
    assert "gfx90a:sramecc+:xnack-" in info.adapter and "wave64" in info.adapter and "110 CUs" in info.adapter
    assert info.memory_bytes == int((60 << 30) * 0.9)
    with pytest.raises(NoDevice, match=r"built for ROCm \(HIP\), not CUDA"):
        cupy_device.probe("ptx")


def test_the_rocm_driver_prepares_and_launches_at_the_devices_wavefront():
    """No refusal for rocm: the kernels are launched with the wavefront's blocks (attention:
    4 wavefronts of 64), which the reference launcher holds to the sources' launch bounds."""
    probe = Probe("AMD Instinct MI250X", 64 << 30, 60 << 30, 110, (9, 0), True, 64, "gfx90a")
    model = synthetic_llama(0)
    cpu, gpu, plan = pair(model, probe=probe)
    assert gpu.backend == "rocm" and gpu.kernels.lanes == 64
    seen = []
    launch = gpu.kernels.launch
    gpu.kernels.launch = lambda name, grid, block, args: (seen.append((name, block)), launch(name, grid, block, args))
    tables = [[0, 1]]
    for d in (cpu, gpu):
        d.step(StepPlan.opening({0: tables[0]}))
    gpu.step(StepPlan([RowWork(0, np.arange(1, 6, dtype=np.int32), 0, tables[0], 1)]))
    assert ("paged_attention_f16", (256,)) in seen and ("rms_norm_f16", (256,)) in seen


def test_a_wavefront_the_kernels_are_not_written_for_is_no_device():
    with pytest.raises(NoDevice, match="wavefront of 16 lanes"):
        CupyDriver("rocm", xp=np, kernels=ReferenceLauncher, probe=Probe("odd", 1 << 30, 1 << 30, 4, (9, 0), True, 16))


def test_a_device_older_than_hopper_is_no_device():
    with pytest.raises(NoDevice, match=r"compute capability 8\.0"):
        CupyDriver("ptx", xp=np, kernels=ReferenceLauncher, probe=Probe("A100", 80 << 30, 80 << 30, 108, (8, 0)))


# ---- failures -----------------------------------------------------------------------------------


def failing_driver(error: BaseException, kernel: str):
    model = synthetic_llama(0)
    _, gpu, plan = pair(model)
    gpu.step(StepPlan.opening({0: [0]}))
    launch = gpu.kernels.launch

    def broken(name, grid, block, args):
        if name.startswith(kernel):
            raise error
        launch(name, grid, block, args)

    gpu.kernels.launch = broken
    return gpu


def test_a_refused_launch_is_a_refused_step():
    gpu = failing_driver(cupy_device.LaunchRefused("launch out of resources"), "paged_attention")
    with pytest.raises(StepRefused, match="LaunchRefused"):
        gpu.step(StepPlan([RowWork(0, np.array([1], np.int32), 0, [0], 1)]))


def test_a_cuda_error_after_work_was_queued_is_a_device_fault(monkeypatch):
    """CuPy's CUDARuntimeError where CuPy is installed; elsewhere a stand-in of the same
    shape, registered as CuPy's error type, so the mapping is checked on every run."""
    try:
        from cupy_backends.cuda.api.runtime import CUDARuntimeError
    except ImportError:
        class CUDARuntimeError(RuntimeError):
            def __init__(self, status):
                self.status = status
                super().__init__("cudaErrorIllegalAddress: an illegal memory access was encountered")

        monkeypatch.setattr(cupy_device, "cuda_errors", lambda: (CUDARuntimeError,))
    gpu = failing_driver(CUDARuntimeError(700), "silu_mul")  # cudaErrorIllegalAddress, at the sync after it
    with pytest.raises(DeviceFault, match="CUDARuntimeError: cudaErrorIllegalAddress"):
        gpu.step(StepPlan([RowWork(0, np.array([1], np.int32), 0, [0], 1)]))


class Coded(RuntimeError):
    """A CUDA error as CuPy raises them: a RuntimeError with the CUDA status code."""

    def __init__(self, status):
        self.status = status
        super().__init__(f"CUDA error {status}")


def test_the_device_launcher_turns_a_refused_launch_into_launch_refused():
    from poot.engine.drivers.cupy_launch import DeviceLauncher, Launcher

    launcher = DeviceLauncher.__new__(DeviceLauncher)  # no device: only its launch call
    Launcher.__init__(launcher, "f16")
    launcher.errors = (Coded,)
    status = {"now": 701}

    def kernel(grid, block, args):
        raise Coded(status["now"])

    launcher.functions = {"add_f32": kernel}
    x = np.zeros(4, np.float32)
    with pytest.raises(cupy_device.LaunchRefused, match=r"add_f32 grid \(1,\) block \(256,\)"):
        launcher.add(x, x, 4)
    status["now"] = 700  # an illegal address surfacing at this call: raised as it is
    with pytest.raises(Coded):
        launcher.add(x, x, 4)


def test_which_cuda_errors_say_the_launch_never_ran():

    assert all(cupy_device.refused(Coded(c)) for c in (1, 9, 701))
    assert not any(cupy_device.refused(Coded(c)) for c in (700, 719, 214, 2))  # illegal address, launch failure, ECC, OOM
    assert not cupy_device.refused(RuntimeError("no status"))
    refused, fault = cupy_device.error_kinds()
    assert refused == (cupy_device.LaunchRefused,)
    assert not set(refused) & set(fault)


# ---- start-up without a device ----------------------------------------------------------------


needs_no_device = pytest.mark.skipif(cuda_device(), reason="this machine has a CUDA device")


@needs_no_device
def test_ptx_without_a_device_fails_saying_what_is_missing(monkeypatch):
    with pytest.raises(NoDevice, match="--backend ptx: "):
        make_driver("ptx")
    monkeypatch.setitem(__import__("sys").modules, "cupy", None)  # CuPy not installed
    with pytest.raises(NoDevice, match=r"CuPy is not installed; pip install 'poot\[ptx\]'"):
        make_driver("ptx")
    with pytest.raises(NoDevice, match="CuPy is not installed"):
        make_driver("rocm")


def test_a_missing_cublas_is_no_device(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "cupy_backends.cuda.libs.cublas", None)
    with pytest.raises(NoDevice, match=r"cuBLAS does not load.*pip install 'poot\[ptx\]'"):
        cupy_device.check_toolchain("ptx")
    with pytest.raises(NoDevice, match=r"--backend rocm: cuBLAS does not load.*pip install 'poot\[rocm\]'"):
        cupy_device.check_toolchain("rocm")


def test_cupy_for_a_platform_this_machine_lacks_names_the_library_that_did_not_load(monkeypatch, tmp_path):
    """CuPy for ROCm without ROCm (or for CUDA without a driver) fails its own import with a
    framed paragraph; start-up says, on one line, which library did not load."""
    import sys

    framed = ("\n=====\nFailed to import CuPy.\n\nOriginal error:\n  ImportError: libamdhip64.so.7: cannot open shared "
              "object file: No such file or directory\n=====\n")
    (tmp_path / "cupy").mkdir()
    (tmp_path / "cupy" / "__init__.py").write_text(f"raise ImportError({framed!r})\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    with pytest.raises(NoDevice) as e:
        cupy_device.probe("rocm")
    assert str(e.value) == ("--backend rocm: CuPy does not import (ImportError: libamdhip64.so.7: cannot open shared "
                            "object file: No such file or directory); pip install 'poot[rocm]' (CuPy for ROCm 7.0) "
                            "on a machine with ROCm 7 and an AMD GPU")


def test_a_missing_hiprtc_is_no_device(monkeypatch):
    import sys
    import types

    libs = types.ModuleType("cupy_backends.cuda.libs")
    libs.cublas = types.ModuleType("cupy_backends.cuda.libs.cublas")  # hipBLAS loads, hiprtc does not
    for name, module in (("cupy_backends", types.ModuleType("cupy_backends")),
                         ("cupy_backends.cuda", types.ModuleType("cupy_backends.cuda")),
                         ("cupy_backends.cuda.libs", libs), ("cupy_backends.cuda.libs.cublas", libs.cublas),
                         ("cupy_backends.cuda.libs.nvrtc", None)):
        monkeypatch.setitem(sys.modules, name, module)
    with pytest.raises(NoDevice, match=r"--backend rocm: hiprtc does not load.*pip install 'poot\[rocm\]'"):
        cupy_device.check_toolchain("rocm")


@needs_no_device
def test_auto_falls_back_to_numpy_whatever_state_cupy_is_in(monkeypatch):
    from poot.engine.drivers import cupy_driver, wgpu_driver

    monkeypatch.setattr(wgpu_driver, "adapters", lambda: [])
    assert make_driver("auto").backend == "numpy"
    monkeypatch.setitem(__import__("sys").modules, "cupy", None)
    assert make_driver("auto").backend == "numpy"

    def broken(*a, **kw):
        raise OSError("libcudart.so.13: cannot open shared object file")

    monkeypatch.setattr(cupy_driver.CupyDriver, "__init__", broken)
    assert make_driver("auto").backend == "numpy"


@needs_no_device
@pytest.mark.parametrize("backend", ["ptx", "rocm"])
def test_poot_serve_on_a_cupy_backend_exits_with_one_line_saying_why(backend):
    from poot.conformance.target import free_port
    from tests.server.proc import run_cli

    r = run_cli("--backend", backend, "--model", "synthetic", "--port", str(free_port()), "--log-level", "warning")
    assert r.returncode == 1
    said = [line for line in r.stderr.splitlines() if line.startswith("poot-serve:")]
    assert len(said) == 1 and said[0].startswith(f"poot-serve: cannot start the engine: NoDevice: --backend {backend}: ")
    assert "Traceback" not in r.stderr + r.stdout
    if backend == "rocm" and "CuPy is not installed" in said[0]:
        assert "pip install 'poot[rocm]'" in said[0]
