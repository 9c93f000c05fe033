"""The wgpu driver against the NumPy driver, step by step: the same logits (1e-4 on the
synthetic model, 1e-3 on SmolLM2) and the same greedy tokens, a fixed compile count, the
adapter limits absorbed, device errors mapped to the loop's two failures."""

from __future__ import annotations

import numpy as np
import pytest

from poot.engine.drivers import StepRefused, make_driver
from poot.engine.drivers.base import DeviceFault, RowWork
from poot.engine.models.synthetic import synthetic_llama
from poot.engine.plan import fit_plan
from tests.backends import missing

BACKENDS = [b for b in ("wgpu", "vulkan")]


def needs(backend: str) -> None:
    reason = missing(backend)
    if reason:
        pytest.skip(reason)


def prepared(driver, model):
    plan = fit_plan(driver.device(), model.config, driver.weight_bytes(model), model.name,
                    kv_bytes_per_token=driver.kv_bytes_per_token(model.config))
    driver.prepare(plan, model)
    return plan


def pair(model, backend="vulkan", **kw):
    """A NumPy and a wgpu driver on one plan (the wgpu driver's), each prepared."""
    from poot.engine.drivers.numpy_driver import NumpyDriver
    from poot.engine.drivers.wgpu_driver import WgpuDriver

    needs(backend)
    gpu = WgpuDriver(backend, **kw)
    plan = prepared(gpu, model)
    cpu = NumpyDriver(memory_bytes=1 << 30)
    cpu.prepare(plan, model)
    return cpu, gpu, plan


def mixed_steps(plan, rng, vocab, n_rows=5):
    """Rows of different lengths: each prefills a prompt in chunks, then all decode together
    while one verifies a few tokens at once (the speculative shape)."""
    prompts = [rng.integers(0, vocab, int(rng.integers(3, 40))).astype(np.int32) for _ in range(n_rows)]
    tables, used = [], 0
    for p in prompts:
        need = plan.blocks_for(len(p) + 8)
        tables.append(list(range(used, used + need))[::-1])  # blocks out of order
        used += need
    prefill = [RowWork(i, p[:-1], 0, t, 1) for i, (p, t) in enumerate(zip(prompts, tables, strict=True))]
    steps = [prefill[i : i + 2] for i in range(0, n_rows, 2)]  # two prefill rows a step, within the budget
    steps.append([RowWork(i, p[-1:], len(p) - 1, t, 1) for i, (p, t) in enumerate(zip(prompts, tables, strict=True))])
    extra = rng.integers(0, vocab, 4).astype(np.int32)
    steps.append([RowWork(0, extra, len(prompts[0]), tables[0], 4)]
                 + [RowWork(i, extra[:1], len(p), t, 1) for i, (p, t) in enumerate(zip(prompts, tables, strict=True))
                    if i])
    return tables, steps


def run_both(cpu, gpu, tables, steps):
    for d in (cpu, gpu):
        for row, t in enumerate(tables):
            d.open_row(row, t)
    for batch in steps:
        yield cpu.step(batch).logits, gpu.step(batch).logits


@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_equal_the_numpy_drivers_on_the_synthetic_model(backend):
    model = synthetic_llama(5)
    cpu, gpu, plan = pair(model, backend)
    tables, steps = mixed_steps(plan, np.random.default_rng(1), model.config.vocab_size)
    for a, b in run_both(cpu, gpu, tables, steps):
        assert a.shape == b.shape
        np.testing.assert_allclose(b, a, atol=1e-4, rtol=0)
        assert (a.argmax(-1) == b.argmax(-1)).all()


def test_compiles_happen_in_prepare_only():
    model = synthetic_llama(5)
    cpu, gpu, plan = pair(model)
    built = gpu.compiles
    assert built > len(gpu.pipelines)  # pipelines and bind groups both count
    tables, steps = mixed_steps(plan, np.random.default_rng(2), model.config.vocab_size, n_rows=plan.rows)
    for _ in run_both(cpu, gpu, tables, steps):
        pass
    assert gpu.compiles == built


def test_big_weights_are_bound_in_windows_within_the_binding_limit():
    """A binding limit smaller than a weight (as lavapipe's 128 MiB is for large vocabularies)
    splits it into windows of rows; the logits do not change."""
    model = synthetic_llama(5)
    cpu, gpu, plan = pair(model)
    gpu.window_bytes = 16 << 10  # the 258 x 64 head and embedding (66 KiB) go in five windows
    gpu.prepare(plan, model)
    assert len(gpu.head_calls) == 5 and len(gpu.embed_calls) == 5
    tables, steps = mixed_steps(plan, np.random.default_rng(3), model.config.vocab_size)
    for a, b in run_both(cpu, gpu, tables, steps):
        np.testing.assert_allclose(b, a, atol=1e-4, rtol=0)


def test_the_plan_keeps_each_layers_kv_within_one_binding():
    from poot.engine.drivers.wgpu_driver import WgpuDriver

    needs("vulkan")
    driver = WgpuDriver("vulkan")
    model = synthetic_llama(0)
    plan = prepared(driver, model)
    per_layer = plan.num_blocks * plan.block_size * driver.kv_bytes_per_token(model.config) // model.config.num_layers
    assert per_layer <= driver.max_binding
    assert plan.backend == "vulkan" and "Vulkan" in plan.adapter


def test_a_device_error_is_a_fault_not_a_crash():
    from poot.engine.drivers.wgpu_driver import WgpuDriver

    needs("vulkan")
    driver = WgpuDriver("vulkan")
    plan = prepared(driver, synthetic_llama(0))
    driver.open_row(0, [0])

    def broken(step, batch):
        raise driver.wgpu.GPUValidationError("lost")

    driver._run = broken
    with pytest.raises(DeviceFault, match="GPUValidationError"):
        driver.step([RowWork(0, np.array([1], np.int32), 0, [0], 1)])
    with pytest.raises(StepRefused, match="not opened"):
        driver.step([RowWork(plan.rows - 1, np.array([1], np.int32), 0, [0], 1)])


def test_vulkan_without_a_vulkan_adapter_fails_start_up_saying_what_to_install(monkeypatch):
    from poot.engine.drivers import wgpu_driver

    monkeypatch.setattr(wgpu_driver, "adapters", lambda: [])
    with pytest.raises(wgpu_driver.NoAdapter, match="mesa-vulkan-drivers"):
        make_driver("vulkan")
    with pytest.raises(wgpu_driver.NoAdapter, match="no WebGPU adapter"):
        make_driver("wgpu")
    assert make_driver("auto").backend == "numpy"


def test_auto_takes_a_cpu_adapter_for_the_cpu_driver():
    """lavapipe is a CPU: auto leaves it to the NumPy driver, which is faster there."""
    from poot.engine.drivers import wgpu_driver

    if any(wgpu_driver.is_hardware(a) for a in wgpu_driver.adapters()):
        pytest.skip("this machine has a hardware GPU adapter")
    assert make_driver("auto").backend == "numpy"


@pytest.mark.realmodel
@pytest.mark.slow
def test_smollm2_logits_and_greedy_tokens_equal_the_numpy_drivers(smollm2):
    """A few prompts, a handful of greedy tokens each (lavapipe is slow): every step's logits
    within 1e-3 of the NumPy driver's, every picked token the same."""
    cpu, gpu, plan = pair(smollm2)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    worst = 0.0
    for row, text in enumerate(prompts):
        ids = np.array(smollm2.encode_prompt(text), np.int32)
        table = list(range(row * 8, row * 8 + plan.blocks_for(len(ids) + 8)))
        for d in (cpu, gpu):
            d.open_row(row, table)
        feed, start, picked = ids, 0, {"cpu": [], "gpu": []}
        for _ in range(5):
            a = cpu.step([RowWork(row, feed, start, table, 1)]).logits[0]
            b = gpu.step([RowWork(row, feed, start, table, 1)]).logits[0]
            worst = max(worst, float(np.abs(a - b).max()))
            np.testing.assert_allclose(b, a, atol=1e-3, rtol=0)
            picked["cpu"].append(int(a.argmax()))
            picked["gpu"].append(int(b.argmax()))
            start += len(feed)
            feed = np.array([picked["cpu"][-1]], np.int32)
        assert picked["cpu"] == picked["gpu"], text
    print(f"largest SmolLM2 logit difference, wgpu against numpy: {worst:.2e}")


def test_poot_serve_on_vulkan_without_a_vulkan_driver_exits_saying_what_to_install():
    import os
    import subprocess
    import sys
    from pathlib import Path

    serve = Path(sys.executable).with_name("poot-serve")
    env = {**os.environ, "VK_ICD_FILENAMES": "/nonexistent/icd.json", "VK_DRIVER_FILES": "/nonexistent/icd.json"}
    run = subprocess.run([str(serve), "--backend", "vulkan", "--model", "synthetic", "--port", "0"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 1
    assert "no Vulkan adapter found" in run.stderr and "mesa-vulkan-drivers" in run.stderr, run.stderr[-2000:]
