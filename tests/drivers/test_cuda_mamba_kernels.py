"""The CUDA driver's Mamba kernels (engine/drivers/cuda/mamba.cu): their NumPy references
over two mixed steps (prefill chunks and decode tokens of several rows, each continuing
from its state slot) against a direct float64 recurrence over each row's whole sequence,
and the kernels against the references (on the CPU at 32 and 64 lanes, and on a GPU where
CuPy sees one). (Their compile checks are in
test_cuda_kernels.py, with every kernel's.)"""

from __future__ import annotations

import numpy as np
import pytest

from engine.drivers.cuda import reference as ref
from tests.drivers.test_cuda_kernels import TOL, WTYPES

DI, DS, KC, RANK = 12, 8, 4, 3
SLOTS = 4
LENGTHS = {2: 7, 0: 4, 3: 5}
STEPS = [[(2, 0, 4), (0, 0, 3)], [(0, 3, 1), (3, 0, 5), (2, 4, 3)]]  # (slot, start, tokens)


def inputs(seed: int):
    rng = np.random.default_rng(seed)
    seq = {s: dict(xz=rng.standard_normal((n, 2 * DI)).astype(np.float32),
                   dbc=rng.standard_normal((n, RANK + 2 * DS)).astype(np.float32),
                   dtr=rng.standard_normal((n, DI)).astype(np.float32)) for s, n in LENGTHS.items()}
    params = dict(conv_w=rng.standard_normal((DI, KC)).astype(np.float32) / 2,
                  conv_b=rng.standard_normal(DI).astype(np.float32) / 4,
                  dt_bias=rng.standard_normal(DI).astype(np.float32) - 1,
                  a=-np.exp(rng.standard_normal((DI, DS))).astype(np.float32),
                  d_skip=rng.standard_normal(DI).astype(np.float32))
    return seq, params


def flat(seq, segments):
    """One step's flat arrays (token_row, row_ids, row_first, row_tokens) and inputs."""
    counts = [n for _, _, n in segments]
    first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int32)
    idx = dict(token_row=np.repeat(np.arange(len(segments)), counts).astype(np.int32),
               row_ids=np.array([s for s, _, _ in segments], np.int32), row_first=first,
               row_tokens=np.array(counts, np.int32))
    data = {k: np.concatenate([seq[s][k][p : p + n] for s, p, n in segments]) for k in ("xz", "dbc", "dtr")}
    return idx, data


def direct(seq, params):
    """Each row's outputs over its whole sequence from zero state, float64."""
    out = {}
    for s, v in seq.items():
        x, z = v["xz"][:, :DI].astype(np.float64), v["xz"][:, DI:].astype(np.float64)
        padded = np.concatenate([np.zeros((KC - 1, DI)), x])
        acc = params["conv_b"] + sum(padded[j : j + len(x)] * params["conv_w"][:, j] for j in range(KC))
        xs = acc / (1 + np.exp(-acc))
        h = np.zeros((DI, DS))
        ys = []
        for p in range(len(x)):
            dt = np.logaddexp(0, v["dtr"][p] + params["dt_bias"].astype(np.float64))
            b, c = v["dbc"][p, RANK : RANK + DS], v["dbc"][p, RANK + DS :]
            h = h * np.exp(dt[:, None] * params["a"]) + (dt * xs[p])[:, None] * b
            ys.append((h @ c + xs[p] * params["d_skip"]) * z[p] / (1 + np.exp(-z[p])))
        out[s] = np.array(ys)
    return out


def run_reference(seq, params, wtype):
    conv_state = np.zeros((SLOTS, KC - 1, DI), np.float32)
    ssm_state = np.zeros((SLOTS, DI, DS), np.float32)
    got = {s: np.zeros((n, DI), np.float32) for s, n in LENGTHS.items()}
    for segments in STEPS:
        idx, d = flat(seq, segments)
        xs, _ = ref.mamba_conv(d["xz"], idx["token_row"], idx["row_ids"], idx["row_first"], idx["row_tokens"],
                               params["conv_w"], params["conv_b"], conv_state, wtype)
        ref.mamba_conv_state(d["xz"], idx["row_ids"], idx["row_first"], idx["row_tokens"], conv_state)
        y = ref.mamba_scan(xs, d["dbc"], d["dtr"], d["xz"], idx["row_ids"], idx["row_first"], idx["row_tokens"],
                           params["dt_bias"], params["a"], params["d_skip"], ssm_state, RANK, wtype)
        for (s, p, n), f in zip(segments, idx["row_first"], strict=True):
            got[s][p : p + n] = ref.w_to_f32(y[f : f + n])
    return got


@pytest.mark.parametrize("wtype", WTYPES)
def test_mamba_references_continue_each_row_from_its_state(wtype):
    seq, params = inputs(7)
    got, want = run_reference(seq, params, wtype), direct(seq, params)
    for s in LENGTHS:
        np.testing.assert_allclose(got[s], want[s], **TOL[wtype])


@pytest.mark.parametrize("wtype", WTYPES)
def test_mamba_kernels_match_the_references(runner, wtype):
    cp, launch = runner
    i32 = np.int32
    seq, params = inputs(8)
    p = {k: cp.asarray(v) for k, v in params.items()}
    conv_state, ssm_state = np.zeros((SLOTS, KC - 1, DI), np.float32), np.zeros((SLOTS, DI, DS), np.float32)
    dev_conv, dev_ssm = cp.asarray(conv_state), cp.asarray(ssm_state)
    for segments in STEPS:
        idx, d = flat(seq, segments)
        t, rows = len(idx["token_row"]), len(segments)
        di, dd = {k: cp.asarray(v) for k, v in idx.items()}, {k: cp.asarray(v) for k, v in d.items()}
        xs, xs_w = cp.zeros((t, DI), cp.float32), cp.zeros((t, DI), np.float16 if wtype == "f16" else np.uint16)
        launch(f"mamba_conv_{wtype}", (-(-DI // 128), t), dd["xz"], di["token_row"], di["row_ids"], di["row_first"],
               p["conv_w"], p["conv_b"], dev_conv, xs, xs_w, i32(DI), i32(KC))
        want_xs, want_w = ref.mamba_conv(d["xz"], idx["token_row"], idx["row_ids"], idx["row_first"],
                                         idx["row_tokens"], params["conv_w"], params["conv_b"], conv_state, wtype)
        np.testing.assert_allclose(xs.get(), want_xs, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(ref.w_to_f32(xs_w.get()), ref.w_to_f32(want_w), **TOL[wtype])
        launch("mamba_conv_state_f32", (-(-DI // 128), rows), dd["xz"], di["row_ids"], di["row_first"],
               di["row_tokens"], dev_conv, i32(DI), i32(KC))
        ref.mamba_conv_state(d["xz"], idx["row_ids"], idx["row_first"], idx["row_tokens"], conv_state)
        np.testing.assert_array_equal(dev_conv.get(), conv_state)
        y = cp.zeros((t, DI), xs_w.dtype)
        launch(f"mamba_scan_{wtype}", (-(-DI // 64), rows), xs, dd["dbc"], dd["dtr"], dd["xz"], di["row_ids"],
               di["row_first"], di["row_tokens"], p["dt_bias"], p["a"], p["d_skip"], dev_ssm, y, i32(DI), i32(DS),
               i32(RANK), i32(RANK + 2 * DS))
        want_y = ref.mamba_scan(xs.get(), d["dbc"], d["dtr"], d["xz"], idx["row_ids"], idx["row_first"],
                                idx["row_tokens"], params["dt_bias"], params["a"], params["d_skip"], ssm_state, RANK,
                                wtype)
        np.testing.assert_allclose(ref.w_to_f32(y.get()), ref.w_to_f32(want_y), **TOL[wtype])
        np.testing.assert_allclose(dev_ssm.get(), ssm_state, rtol=1e-4, atol=1e-5)
