"""A Llama-family decoder stack in one compiled call: for every layer, the norm, the QKV
product, rotary with the KV write, paged attention, the output product added to the
residual, the norm, gate/up, SiLU times up and the down product added. The same kernels the
op-by-op walk calls (glue.py, integer.py, attention.py), in the same order on the same values, so a
token's result is the same bits either way; what goes is the 270 trips through Python a step
of SmolLM2 took between them (decoder_stack.py says when this runs). Its machine code holds
theirs, so its cache stamp covers their files (runtime.py's KernelCacheStamp).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .attention import paged_attention
from .glue import rms_run, rms_scale, rope_run, rope_store, silu_mul, silu_rows
from .integer import int8_product
from .numeric import ERRORS, FASTMATH
from .sizes import GLUE_PARALLEL_MIN, TOKEN_RUN


@njit(inline="always", boundscheck=False, error_model=ERRORS)
def _run_length(tokens, threads):
    """cpu/glue.py's run_length, in compiled code."""
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
    (products/integer.py's IntegerPath) stacked over the layers (order: the same for all);
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

