"""The Mamba family: the batched step against a token-by-token reference, chunked prefill
equals one-shot, batched equals alone, a row opened by a new sequence starts from zero state
(each on every selected backend), no prefix is ever registered, and loading from GGUF."""

from __future__ import annotations

import numpy as np
import pytest
from poot_mutants.engine_parts import RegisterRecurrentPrefix, StaleRecurrentState

from poot.engine import Engine, SamplingParams
from poot.engine.drivers.base import RowWork, StepPlan
from poot.engine.drivers.cpu import CpuDriver
from poot.engine.models.base import ModelLoadError
from poot.engine.models.mamba import load_mamba_gguf
from poot.engine.models.synthetic import synthetic_mamba
from poot.engine.plan import fit_plan
from tests.backends import driver_factory, params

from .harness import greedy, run_until_idle, submit

# The NumPy driver computes in float32 like the reference's float64 to about 1e-6; a device's
# kernels sum in another order and use its own exp and log.
TOLERANCE = {"numpy": 1e-5, "wgpu": 1e-4, "vulkan": 1e-4, "ptx": 2e-2, "rocm": 2e-2}  # ptx, rocm: fp16 words


def reference_logits(model, tokens: list[int]) -> np.ndarray:
    """Mamba-1 written plainly from the paper, one token at a time: logits at every position."""
    c, w = model.config, model.weights
    conv = [np.zeros((c.d_conv, c.d_inner)) for _ in range(c.num_layers)]  # last d_conv inputs
    ssm = [np.zeros((c.d_inner, c.d_state)) for _ in range(c.num_layers)]

    def rms(x, g):
        return x / np.sqrt(np.mean(x * x) + c.rms_eps) * g

    def silu(x):
        return x / (1 + np.exp(-x))

    out = []
    for t in tokens:
        x = w["embed"][t].astype(np.float64)
        for i in range(c.num_layers):
            p = f"layers.{i}."
            xz = w[p + "in_proj"] @ rms(x, w[p + "norm"])
            xi, z = xz[: c.d_inner], xz[c.d_inner :]
            conv[i] = np.vstack([conv[i][1:], xi])
            u = silu((conv[i] * w[p + "conv_w"].T).sum(axis=0) + w[p + "conv_b"])
            dbc = w[p + "x_proj"] @ u
            dt = np.log1p(np.exp(w[p + "dt_proj"] @ dbc[: c.dt_rank] + w[p + "dt_bias"]))
            b, cc = dbc[c.dt_rank : c.dt_rank + c.d_state], dbc[c.dt_rank + c.d_state :]
            ssm[i] = np.exp(dt[:, None] * w[p + "A"]) * ssm[i] + (dt * u)[:, None] * b[None, :]
            y = ssm[i] @ cc + w[p + "D"] * u
            x = x + w[p + "out_proj"] @ (y * silu(z))
        out.append(w["lm_head"] @ rms(x, w["norm"]))
    return np.array(out)


def make_driver(model=None, cls=CpuDriver, backend="numpy"):
    model = model or synthetic_mamba(1)
    driver = (cls if backend == "numpy" else driver_factory(backend))(memory_bytes=1 << 30)
    plan = fit_plan(driver.device(), model.config, 0, model.name)
    driver.prepare(plan, model)
    return driver, plan


def prefill(driver, row, tokens, chunk=1000):
    out = None
    driver.step(StepPlan.opening({row: []}))  # a new sequence: the row starts from zero state
    for start in range(0, len(tokens), chunk):
        piece = tokens[start : start + chunk]
        last = start + len(piece) == len(tokens)
        out = driver.step(StepPlan([RowWork(row, np.array(piece, np.int32), start, [], 1 if last else 0)]))
    return out.logits[0]


def prompts(seed, n, lo=3, hi=50):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, rng.integers(lo, hi)).tolist() for _ in range(n)]


@pytest.mark.parametrize("backend", params())
def test_the_plan_has_state_slots_and_no_kv_blocks(backend):
    _, plan = make_driver(backend=backend)
    assert plan.num_blocks == 0 and plan.state_slots == plan.rows


@pytest.mark.parametrize("backend", params())
def test_a_step_matches_the_token_by_token_reference(backend):
    model = synthetic_mamba(1)
    driver, _ = make_driver(model, backend=backend)
    (p,) = prompts(0, 1, 30, 31)
    reference = reference_logits(model, p)
    np.testing.assert_allclose(prefill(driver, 0, p), reference[-1], atol=TOLERANCE[backend], rtol=0)
    # Then decoding, a token a step, from the state the prefill left.
    prefill(driver, 1, p[:5])
    for n in range(5, 12):
        out = driver.step(StepPlan([RowWork(1, np.array([p[n]], np.int32), n, [], 1)]))
        np.testing.assert_allclose(out.logits[0], reference[n], atol=TOLERANCE[backend], rtol=0)


@pytest.mark.parametrize("backend", params())
def test_steps_of_any_shape_build_nothing_after_prepare(backend):
    driver, plan = make_driver(backend=backend)
    built = driver.compiles
    ps = prompts(5, plan.rows, 1, 40)
    for chunk in (1, 5, 64):
        for row, p in enumerate(ps):
            prefill(driver, row, p, chunk)
    driver.step(StepPlan([RowWork(row, np.array([7], np.int32), len(p), [], 1) for row, p in enumerate(ps)]))
    assert driver.compiles == built


@pytest.mark.parametrize("backend", params())
def test_chunked_prefill_equals_one_shot_prefill(backend):
    driver, _ = make_driver(backend=backend)
    (p,) = prompts(1, 1, 40, 90)
    one_shot = prefill(driver, 0, p)
    for chunk in (1, 3, 7, 16, 33):
        np.testing.assert_allclose(prefill(driver, 0, p, chunk), one_shot, atol=TOLERANCE[backend], rtol=0)


@pytest.mark.parametrize("backend", params())
def test_each_row_in_a_mixed_batch_matches_its_logits_alone(backend):
    driver, _ = make_driver(backend=backend)
    ps = prompts(2, 6)
    alone = [prefill(driver, 0, p) for p in ps]
    driver.step(StepPlan.opening({0: []}))
    for i, p in enumerate(ps[1:], start=1):  # rows 1..5 prefill all but their last token
        driver.step(StepPlan.opening({i: []}))
        driver.step(StepPlan([RowWork(i, np.array(p[:-1], np.int32), 0, [], 0)]))
    batch = [RowWork(0, np.array(ps[0], np.int32), 0, [], 1)]
    batch += [RowWork(i, np.array(p[-1:], np.int32), len(p) - 1, [], 1) for i, p in enumerate(ps[1:], start=1)]
    np.testing.assert_allclose(driver.step(StepPlan(batch)).logits, np.stack(alone), atol=TOLERANCE[backend], rtol=0)


@pytest.mark.parametrize("backend", params())
def test_a_row_reopened_on_a_backend_starts_from_zero_state(backend):
    fresh, _ = make_driver(backend=backend)
    reused, _ = make_driver(backend=backend)
    first, second = prompts(3, 2, 20, 21)
    prefill(reused, 4, first)  # the row's previous owner leaves its state behind
    np.testing.assert_allclose(prefill(reused, 4, second), prefill(fresh, 4, second), atol=TOLERANCE[backend], rtol=0)


@pytest.mark.parametrize("cls", [CpuDriver, StaleRecurrentState], ids=["reference", "stale_recurrent_state"])
def test_a_row_opened_by_a_new_sequence_starts_from_zero_state(cls):
    fresh, _ = make_driver()
    reused, _ = make_driver(cls=cls)
    first, second = prompts(3, 2, 20, 21)
    prefill(reused, 4, first)  # the row's previous owner leaves its state behind
    same = np.allclose(prefill(reused, 4, second), prefill(fresh, 4, second), atol=1e-5, rtol=0)
    assert same == (cls is CpuDriver)


def engine(backend="numpy", **parts):
    driver = (CpuDriver if backend == "numpy" else driver_factory(backend))(memory_bytes=1 << 30)
    return Engine.create(synthetic_mamba(0), driver=driver, **parts)


@pytest.mark.parametrize("backend", params())
def test_batched_requests_through_the_engine_equal_each_alone(backend):
    ps = [bytes(p).decode("latin-1") for p in prompts(4, 5, 5, 300)]
    alone = []
    for p in ps:
        e = engine(backend)
        rec, _ = submit(e, p, greedy(12, ignore_eos=True))
        run_until_idle(e)
        alone.append(rec.token_ids)
    e = engine(backend)
    recs = [submit(e, p, greedy(12, ignore_eos=True))[0] for p in ps]
    run_until_idle(e)
    assert [r.token_ids for r in recs] == alone


def test_the_recurrent_family_registers_nothing_and_counts_skipped_releases():
    e = engine()
    for salt in range(3):
        rec, _ = submit(e, "x" * 40 + str(salt), SamplingParams(max_tokens=3, temperature=0.7, seed=salt))
    run_until_idle(e)
    rec, _ = submit(e, "x" * 40 + "0", greedy(3))
    run_until_idle(e)
    m = e.metrics()
    assert m["prefix_registered_tokens"] == 0 and m["kv_blocks_cached"] == 0
    assert m["prefix_skipped_releases"] == 4
    assert rec.finished.cached_tokens == 0 and m["prefix_cache_hit_rate"] == 0.0


def test_register_recurrent_prefix_mutation_registers_anyway_and_skips_nothing():
    e = engine(prefix_cache=RegisterRecurrentPrefix)
    submit(e, "x" * 40, greedy(3))
    run_until_idle(e)
    m = e.metrics()
    assert m["prefix_registered_tokens"] == 32 and m["prefix_skipped_releases"] == 0


# ---- GGUF -------------------------------------------------------------------------------------

GGUF_NAMES = {"norm": "attn_norm.weight", "in_proj": "ssm_in.weight", "conv_w": "ssm_conv1d.weight",
              "conv_b": "ssm_conv1d.bias", "x_proj": "ssm_x.weight", "dt_proj": "ssm_dt.weight",
              "dt_bias": "ssm_dt.bias", "A": "ssm_a", "D": "ssm_d", "out_proj": "ssm_out.weight"}


def write_gguf(path, model, drop: str | None = None, f16: bool = False):
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_name("tiny-mamba")
    w.add_context_length(c.max_positions)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_layers)
    w.add_ssm_conv_kernel(c.d_conv)
    w.add_ssm_inner_size(c.d_inner)
    w.add_ssm_state_size(c.d_state)
    w.add_ssm_time_step_rank(c.dt_rank)
    w.add_layer_norm_rms_eps(c.rms_eps)
    names = {"embed": "token_embd.weight", "norm": "output_norm.weight", "lm_head": "output.weight"}
    for i in range(c.num_layers):
        names |= {f"layers.{i}.{k}": f"blk.{i}.{v}" for k, v in GGUF_NAMES.items()}
    for canon, name in names.items():
        if name != drop:
            a = model.weights[canon]
            w.add_tensor(name, a.astype(np.float16) if f16 and a.ndim == 2 else a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_gguf_mamba_loads_to_the_same_weights_and_logits(tmp_path):
    model = synthetic_mamba(5)
    write_gguf(tmp_path / "m.gguf", model)
    loaded = load_mamba_gguf(tmp_path / "m.gguf")
    assert loaded.config == model.config and loaded.name == "tiny-mamba"
    assert loaded.config.family == "mamba" and loaded.config.recurrent
    for k, v in model.weights.items():
        np.testing.assert_array_equal(loaded.weights[k], v)
    p = prompts(6, 1, 20, 21)[0]
    np.testing.assert_allclose(prefill(make_driver(loaded)[0], 0, p), prefill(make_driver(model)[0], 0, p),
                               atol=1e-6, rtol=0)
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("hi")) == "hi"


def test_a_gguf_reader_and_f16_tensors_are_accepted(tmp_path):
    import gguf

    model = synthetic_mamba(5)
    write_gguf(tmp_path / "m.gguf", model, f16=True)
    loaded = load_mamba_gguf(gguf.GGUFReader(str(tmp_path / "m.gguf")))
    np.testing.assert_allclose(loaded.weights["layers.1.in_proj"], model.weights["layers.1.in_proj"], atol=1e-2)


def test_a_gguf_missing_a_tensor_fails_with_its_name(tmp_path):
    write_gguf(tmp_path / "m.gguf", synthetic_mamba(5), drop="blk.1.ssm_d")
    with pytest.raises(ModelLoadError, match=r"missing tensor blk\.1\.ssm_d"):
        load_mamba_gguf(tmp_path / "m.gguf")
