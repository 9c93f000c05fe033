"""A Llama-family decoder stack in one compiled call: for every layer, the norm, the QKV
product, rotary with the KV write, paged attention, the output product added to the
residual, the norm, gate/up, SiLU times up and the down product added. The same kernels the
op-by-op walk calls (cpu_kernels_numba, cpu_int8_kernels, cpu_attention_kernels), in the same
order on the same values, so a token's result is the same bits either way; what goes is the
270 trips through Python a step of SmolLM2 took between them (cpu_layers says when this runs).

numba checks a cached kernel against its own source file only, but this one's machine code
holds its callees' too (numba links them into it): the cache locator below stamps it with
every file it calls into as well, so editing a callee rebuilds it.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
from numba import njit
from numba.core import caching

# The kernel modules this one's machine code includes (see the module's docstring), and the
# policy module whose thresholds it takes (numba freezes a global's value into the code).
_HERE = os.path.dirname(os.path.abspath(__file__))
CALLEE_FILES = tuple(os.path.join(_HERE, f"{name}.py") for name in
                     ("cpu_kernels_numba", "cpu_int8_kernels", "cpu_attention_kernels", "cpu_kernels"))


class _StampedWithCallees:
    """Mixin for numba's source-backed cache locators: this file's stamp and its callees'."""

    @classmethod
    def from_function(cls, py_func, py_file):
        if os.path.abspath(py_file) != os.path.abspath(__file__):
            return None  # every other kernel keeps numba's own locators
        return super().from_function(py_func, py_file)

    def get_source_stamp(self):
        digest = hashlib.sha256(repr(super().get_source_stamp()).encode())
        for path in CALLEE_FILES:
            with open(path, "rb") as f:
                digest.update(f.read())
        return digest.hexdigest()


class _InTree(_StampedWithCallees, caching.InTreeCacheLocator):
    pass


class _UserWide(_StampedWithCallees, caching.UserWideCacheLocator):
    pass


# Ahead of numba's own locators; each takes this file's kernels only. (CacheImpl was
# _CacheImpl before numba 0.68.)
_locators = (getattr(caching, "CacheImpl", None) or caching._CacheImpl)._locator_classes
for _locator in (_UserWide, _InTree):
    if _locator not in _locators:
        _locators.insert(0, _locator)

from .cpu_attention_kernels import paged_attention  # noqa: E402  (after the locators: import compiles nothing)
from .cpu_int8_kernels import int8_product  # noqa: E402
from .cpu_kernels import GLUE_PARALLEL_MIN, TOKEN_RUN  # noqa: E402
from .cpu_kernels_numba import (  # noqa: E402
    ERRORS,
    FASTMATH,
    rms_run,
    rms_scale,
    rope_run,
    rope_store,
    silu_mul,
    silu_rows,
)


@njit(inline="always", boundscheck=False, error_model=ERRORS)
def _run_length(tokens, threads):
    """cpu_kernels.run_length, in compiled code."""
    runs = threads * -(-tokens // (threads * TOKEN_RUN))
    return -(-tokens // runs)


@njit(inline="always", boundscheck=False, error_model=ERRORS)
def _norm(x, eps, out, start, threads):
    if x.size >= GLUE_PARALLEL_MIN:
        rms_scale(x, eps, out, _run_length(x.shape[1], threads))
    else:
        rms_run(x, eps, out, start, x.shape[1])


@njit(inline="always", boundscheck=False, error_model=ERRORS)
def _product(weight, layer, x, out, add):
    codes, d, m, dw, mw, order, colscale = weight
    int8_product(codes[layer], d[layer], m[layer], dw[layer], mw[layer], order, x, colscale[layer], out,
                 out.shape[0] < 0, add)  # feature-major out (a literal False would build a new version)


@njit(nogil=True, fastmath=FASTMATH, cache=True, boundscheck=False, error_model=ERRORS)
def decoder_layers(x, qkv_w, out_w, gate_up_w, down_w, kv, rope, block, offset, tables, table_of, lengths, eps,
                   heads, threads):
    """x (hidden, T) feature-major, the residual stream, updated in place through every layer.
    qkv_w, out_w, gate_up_w, down_w: each layer's product of that role as
    (codes, d, m, dw, mw, order, colscale), the integer path's arrays
    (cpu_block_products.BlockProduct) stacked over the layers (order: the same for all);
    kv (layers, ...) every layer's paged cache; rope (T, head_dim) cos, sin interleaved;
    block, offset: each token's KV slot; tables, table_of, lengths: the paged queries' (every
    token is one); threads: numba's thread count (for the runs of the glue kernels)."""
    tokens = x.shape[1]
    # Non-literal 0 and True: a literal argument would build new versions of the callees.
    start = tokens - tokens
    add = tokens > 0
    h = np.empty_like(x)
    for layer in range(kv.shape[0]):
        cache = kv[layer]
        head_dim = cache.shape[4]
        _norm(x, eps, h, start, threads)
        qkv = np.empty((qkv_w[0].shape[1], tokens), np.float32)
        _product(qkv_w, layer, h, qkv, not add)
        q = np.empty((tokens, heads, head_dim), np.float32)
        if qkv.size >= GLUE_PARALLEL_MIN:
            rope_store(qkv, rope, block, offset, cache, q, _run_length(tokens, threads))
        else:
            rope_run(qkv, rope, block, offset, cache, q, start, tokens)
        att = np.empty((tokens, heads * head_dim), np.float32)
        paged_attention(q, cache, tables, table_of, lengths, att)
        _product(out_w, layer, np.ascontiguousarray(att.T), x, add)
        _norm(x, eps, h, start, threads)
        gate_up = np.empty((gate_up_w[0].shape[1], tokens), np.float32)
        _product(gate_up_w, layer, h, gate_up, not add)
        act = np.empty((gate_up.shape[0] // 2, tokens), np.float32)
        if gate_up.size >= GLUE_PARALLEL_MIN:
            silu_mul(gate_up, act)
        else:
            silu_rows(gate_up, act, start, act.shape[0])
        _product(down_w, layer, act, x, add)


KERNELS = (decoder_layers,)
