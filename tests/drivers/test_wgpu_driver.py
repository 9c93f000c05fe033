"""The wgpu driver against the NumPy driver, step by step: the same logits (1e-4 on the
synthetic model, 1e-3 on SmolLM2) and the same greedy tokens, the same tokens picked on the
device (greedy and seeded sampling) as the host picks from the same logits, a fixed compile
count, the adapter limits absorbed, device errors mapped to the loop's two failures."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from poot.engine import SamplingParams
from poot.engine.drivers import StepRefused, make_driver
from poot.engine.drivers.base import DeviceFault, Pick, RowWork, StepPlan
from poot.engine.models.synthetic import synthetic_llama
from poot.engine.plan import fit_plan
from poot.engine.random_stream import philox4x32, random_stream
from tests.backends import missing
from tests.drivers.picks import PICKED, host_picks, with_picks

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
    from poot.engine.drivers.cpu import CpuDriver
    from poot.engine.drivers.wgpu_driver import WgpuDriver

    needs(backend)
    gpu = WgpuDriver(backend, **kw)
    plan = prepared(gpu, model)
    cpu = CpuDriver(memory_bytes=1 << 30, compact=False)
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
            d.step(StepPlan.opening({row: t}))
    for batch in steps:
        yield cpu.step(StepPlan(batch)).logits, gpu.step(StepPlan(batch)).logits


@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_equal_the_numpy_drivers_on_the_synthetic_model(backend):
    model = synthetic_llama(5)
    cpu, gpu, plan = pair(model, backend)
    tables, steps = mixed_steps(plan, np.random.default_rng(1), model.config.vocab_size)
    for a, b in run_both(cpu, gpu, tables, steps):
        assert a.shape == b.shape
        np.testing.assert_allclose(b, a, atol=1e-4, rtol=0)
        assert (a.argmax(-1) == b.argmax(-1)).all()


# What the device picks: greedy, and sampling with each cut alone and together.
def test_wgsl_philox_gives_the_hosts_words():
    """The kernel's Philox4x32-10 (16-bit halves for each 64-bit product) against the host's,
    on Random123's known-answer inputs and random ones."""
    from poot.engine.drivers import wgsl
    from poot.engine.drivers.wgpu_driver import WgpuDriver

    needs("vulkan")
    dev = WgpuDriver("vulkan").device_
    rng = np.random.default_rng(0)
    inputs = rng.integers(0, 2**32, (500, 6), dtype=np.uint64)
    inputs[:3] = [[0] * 6, [2**32 - 1] * 6, [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344, 0xA4093822, 0x299F31D0]]
    code = """
@group(0) @binding(0) var<storage, read> inp: array<u32>;
@group(0) @binding(1) var<storage, read_write> out: array<vec4<u32>>;
""" + wgsl.PHILOX + """
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let i = gid.x;
  if (i >= arrayLength(&out)) { return; }
  let b = i * 6u;
  out[i] = philox(vec4<u32>(inp[b], inp[b + 1u], inp[b + 2u], inp[b + 3u]), vec2<u32>(inp[b + 4u], inp[b + 5u]));
}
"""
    u = dev.create_buffer_with_data(data=inputs.astype(np.uint32), usage=0x80)  # STORAGE
    out = dev.create_buffer(size=len(inputs) * 16, usage=0x80 | 0x04)  # STORAGE | COPY_SRC
    pipeline = dev.create_compute_pipeline(layout="auto", compute={"module": dev.create_shader_module(code=code),
                                                                   "entry_point": "main"})
    group = dev.create_bind_group(layout=pipeline.get_bind_group_layout(0), entries=[
        {"binding": 0, "resource": {"buffer": u, "offset": 0, "size": u.size}},
        {"binding": 1, "resource": {"buffer": out, "offset": 0, "size": out.size}}])
    encoder = dev.create_command_encoder()
    cp = encoder.begin_compute_pass()
    cp.set_pipeline(pipeline)
    cp.set_bind_group(0, group)
    cp.dispatch_workgroups(-(-len(inputs) // 64))
    cp.end()
    dev.queue.submit([encoder.finish()])
    got = np.frombuffer(dev.queue.read_buffer(out), np.uint32).reshape(-1, 4)
    c = tuple(inputs[:, i] for i in range(4))
    want = np.stack(philox4x32(c, (inputs[:, 4], inputs[:, 5])), axis=1)
    assert got[1].tolist() == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    np.testing.assert_array_equal(got, want.astype(np.uint32))


@pytest.mark.parametrize("backend, workgroup", [(b, 64) for b in BACKENDS] + [("vulkan", 256)])
def test_tokens_picked_on_the_device_are_the_hosts_picks_from_the_same_logits(backend, workgroup, monkeypatch):
    """Greedy on the device is the argmax of the logits the step would have returned; a
    sampled row is the host sampler's pick with the row's stream; unmarked rows still get
    their logits, and the NumPy driver picks the same tokens. With a CPU adapter's picking
    workgroup and a hardware GPU's (256 invocations), which runs here on lavapipe too."""
    from poot.engine.drivers import wgpu_driver

    monkeypatch.setattr(wgpu_driver, "CPU_ADAPTER_PICK_WG", workgroup)
    model = synthetic_llama(5)
    cpu, gpu, plan = pair(model, backend)
    tables, steps = mixed_steps(plan, np.random.default_rng(4), model.config.vocab_size, n_rows=plan.rows)
    steps = with_picks(steps)
    for d in (cpu, gpu):
        for row, t in enumerate(tables):
            d.step(StepPlan.opening({row: t}))
    full = []
    gpu.device_picks = False
    for batch in steps:
        full.append(gpu.step(StepPlan(batch)).logits)
    gpu.device_picks = True
    marked_somewhere = 0
    for batch, logits in zip(steps, full, strict=True):
        out, on_cpu = gpu.step(StepPlan(batch)), cpu.step(StepPlan(batch))
        want = host_picks(logits, batch)
        assert out.token_ids.tolist() == want == on_cpu.token_ids.tolist()
        assert out.picked == on_cpu.picked == [w.pick is not None and w.num_logits > 0 for w in batch]
        host = np.array(want) < 0
        np.testing.assert_array_equal(out.logits, logits[host])
        marked_somewhere += int((~host).sum())
    assert marked_somewhere > 10


def test_many_seeded_draws_on_the_device_are_the_hosts():
    """Every sampling rule, many counters: each draw the device makes is the one the host's
    sampler makes from the same logits with the same uniform."""
    model = synthetic_llama(5)
    _, gpu, plan = pair(model)
    tables, steps = mixed_steps(plan, np.random.default_rng(6), model.config.vocab_size, n_rows=plan.rows)
    for row, t in enumerate(tables):
        gpu.step(StepPlan.opening({row: t}))
    for batch in steps[:-1]:  # the prompts, prefilled, then one decode step of every row
        gpu.step(StepPlan(batch))
    last = steps[-1]  # every row decodes again, one of them verifying 4 tokens
    gpu.device_picks = False
    logits = gpu.step(StepPlan(last)).logits
    gpu.device_picks = True
    draws = 0
    for params in PICKED[1:]:
        for k in range(25):
            batch = [RowWork(w.row, w.tokens, w.start, w.block_table, w.num_logits,
                             Pick(params, random_stream(1000 * k + w.row, k % 2), k)) for w in last]
            assert gpu.step(StepPlan(batch)).token_ids.tolist() == host_picks(logits, batch), (params, k)
            draws += len(batch)
    assert draws >= 5 * 25 * 2


def test_a_step_picked_whole_on_the_device_reads_back_no_logits():
    model = synthetic_llama(5)
    cpu, gpu, plan = pair(model)
    tables, steps = mixed_steps(plan, np.random.default_rng(5), model.config.vocab_size)
    steps = with_picks(steps, host_every=10**6)
    for row, t in enumerate(tables):
        gpu.step(StepPlan.opening({row: t}))
    for batch in steps:
        out = gpu.step(StepPlan(batch))
        assert out.logits.shape == (0, model.config.vocab_size)
        assert len(out.token_ids) == sum(w.num_logits for w in batch) and (out.token_ids >= 0).all()
        assert out.picked == [w.num_logits > 0 for w in batch]


def test_compiles_happen_in_prepare_only():
    model = synthetic_llama(5)
    cpu, gpu, plan = pair(model)
    built = gpu.compiles
    assert built > len(gpu.pipelines)  # pipelines and bind groups both count
    tables, steps = mixed_steps(plan, np.random.default_rng(2), model.config.vocab_size, n_rows=plan.rows)
    for _ in run_both(cpu, gpu, tables, steps):
        pass
    for batch in with_picks(steps):  # the device's picking was prepared too
        gpu.step(StepPlan(batch))
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
    driver.step(StepPlan.opening({0: [0]}))

    def broken(step, batch):
        raise driver.wgpu.GPUValidationError("lost")

    driver.run_step = broken
    with pytest.raises(DeviceFault, match="GPUValidationError"):
        driver.step(StepPlan([RowWork(0, np.array([1], np.int32), 0, [0], 1)]))
    with pytest.raises(StepRefused, match="not opened"):
        driver.step(StepPlan([RowWork(plan.rows - 1, np.array([1], np.int32), 0, [0], 1)]))


def test_vulkan_without_a_vulkan_adapter_fails_start_up_saying_what_to_install(monkeypatch):
    from poot.engine import drivers
    from poot.engine.drivers import wgpu_driver

    monkeypatch.setattr(wgpu_driver, "adapters", lambda: [])
    monkeypatch.setattr(drivers, "_cuda_driver", lambda: (None, "none here"))  # auto would take a CUDA device first
    monkeypatch.setattr(drivers, "gpu_device_files", lambda: ["/dev/dri/renderD128"])  # auto probes
    with pytest.raises(wgpu_driver.NoAdapter, match="mesa-vulkan-drivers"):
        make_driver("vulkan")
    with pytest.raises(wgpu_driver.NoAdapter, match="no WebGPU adapter"):
        make_driver("wgpu")
    assert make_driver("auto").backend == "numpy"


def test_auto_takes_a_cpu_adapter_for_the_cpu_driver(monkeypatch):
    """lavapipe is a CPU: auto leaves it to the NumPy driver, which is faster there."""
    from poot.engine import drivers
    from poot.engine.drivers import wgpu_driver

    monkeypatch.setattr(drivers, "_cuda_driver", lambda: (None, "none here"))  # auto would take a CUDA device first
    monkeypatch.setattr(drivers, "gpu_device_files", lambda: ["/dev/dri/renderD128"])  # auto probes the adapters

    if any(wgpu_driver.is_hardware(a) for a in wgpu_driver.adapters()):
        pytest.skip("this machine has a hardware GPU adapter")
    assert make_driver("auto").backend == "numpy"


def test_auto_on_a_machine_without_gpu_device_files_probes_nothing(monkeypatch, caplog):
    """No /dev/dri render node, no NVIDIA or AMD compute file: no hardware adapter can exist, so
    auto neither loads wgpu-py and Mesa nor CuPy (about two seconds of a start) and says why."""
    from poot.engine import drivers
    from poot.engine.drivers import wgpu_driver

    def probed(*a):
        raise AssertionError("probed a device")

    monkeypatch.setattr(drivers, "gpu_device_files", lambda: [])
    monkeypatch.setattr(drivers, "_cuda_driver", probed)
    monkeypatch.setattr(wgpu_driver, "adapters", probed)
    with caplog.at_level("INFO", logger="poot.engine"):
        assert make_driver("auto").backend == "numpy"
    assert [r.getMessage() for r in caplog.records if "backend auto" in r.getMessage()] == [
        "backend auto: no GPU device file (/dev/dri/renderD*, /dev/nvidia[0-9]*, /dev/kfd, /dev/dxg): numpy, the CPU"]


def test_listing_adapters_without_xdg_runtime_dir_prints_no_error():
    """Mesa's drivers look for a Wayland display while wgpu lists adapters; without
    XDG_RUNTIME_DIR libwayland printed an error line per driver (`--backend wgpu` or `vulkan`,
    or auto on a machine with a GPU device file)."""
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    done = subprocess.run([sys.executable, "-c", "from poot.engine.drivers.wgpu_driver import adapters; "
                           "print(len(adapters()))"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "error" not in (done.stdout + done.stderr).lower(), done.stderr


def test_gpu_device_files_are_read_on_linux_only(monkeypatch):
    from poot.engine import drivers

    monkeypatch.setattr(drivers.sys, "platform", "darwin")
    assert drivers.gpu_device_files() is None  # Metal: nothing to look at, so auto probes
    monkeypatch.setattr(drivers.sys, "platform", "linux")
    monkeypatch.setattr(drivers.glob, "glob", lambda pattern: ["/dev/dri/renderD128"] if "dri" in pattern else [])
    assert drivers.gpu_device_files() == ["/dev/dri/renderD128"]


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
            d.step(StepPlan.opening({row: table}))
        feed, start, picked = ids, 0, {"cpu": [], "gpu": []}
        for _ in range(5):
            a = cpu.step(StepPlan([RowWork(row, feed, start, table, 1)])).logits[0]
            b = gpu.step(StepPlan([RowWork(row, feed, start, table, 1)])).logits[0]
            worst = max(worst, float(np.abs(a - b).max()))
            np.testing.assert_allclose(b, a, atol=1e-3, rtol=0)
            picked["cpu"].append(int(a.argmax()))
            picked["gpu"].append(int(b.argmax()))
            start += len(feed)
            feed = np.array([picked["cpu"][-1]], np.int32)
        assert picked["cpu"] == picked["gpu"], text
    print(f"largest SmolLM2 logit difference, wgpu against numpy: {worst:.2e}")


@pytest.mark.realmodel
@pytest.mark.slow
def test_smollm2_tokens_picked_on_the_device_equal_the_numpy_drivers(smollm2):
    """SmolLM2's 49152-token vocabulary: three rows in one step, greedy, sampled with top-k
    and top-p, sampled with top-p alone, each picking on the device what the NumPy driver
    picks, for a few tokens each (lavapipe is slow)."""
    cpu, gpu, plan = pair(smollm2)
    rules = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
             SamplingParams(temperature=1.0, top_p=0.95)]
    prompts = [np.array(smollm2.encode_prompt(t), np.int32) for t in ("The capital of France is", "def add(a, b):",
                                                                      "Once upon a time")]
    tables = [list(range(r * 8, r * 8 + plan.blocks_for(len(p) + 8))) for r, p in enumerate(prompts)]
    for d in (cpu, gpu):
        for r, t in enumerate(tables):
            d.step(StepPlan.opening({r: t}))
    feeds, starts, picked = list(prompts), [0] * 3, [[] for _ in prompts]
    for k in range(4):
        batch = [RowWork(r, feeds[r], starts[r], tables[r], 1, Pick(rules[r], random_stream(42, r), k))
                 for r in range(3)]
        a, b = cpu.step(StepPlan(batch)).token_ids, gpu.step(StepPlan(batch)).token_ids
        assert b.tolist() == a.tolist(), k
        for r in range(3):
            picked[r].append(int(a[r]))
            starts[r] += len(feeds[r])
            feeds[r] = a[r : r + 1].astype(np.int32)
    assert len({tuple(p) for p in picked}) == 3


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
