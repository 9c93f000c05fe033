"""Where the CuPy driver keeps each buffer and weight of a Program, in the precision plan of
engine/drivers/cuda/kernels.cu and mamba.cu: derived from the op list alone (no family name),
so weight_bytes() can count before prepare() and prepare() allocates from the same answer.

- A buffer is 16-bit words (W) when the op writing it stores W (what a product reads next),
  else fp32 (the residual stream, the products' outputs, rotated q, Mamba's xs, dbc, dtr).
- The conv op writes xs twice: fp32 for the scan, a W copy (`xs/w`) for the product.
- A product reads W words with W weights (cuBLAS on the tensor cores, fp32 out); one whose
  input exists in fp32 only (Mamba's dt projection reads dbc) runs in fp32 with fp32 weights.
- Tables and per-channel parameters the kernels read as fp32 (the rotary table, the conv's
  and the scan's weights) stay fp32; everything else is W.
"""

from __future__ import annotations

from dataclasses import dataclass

HALF_OUTPUTS = frozenset({"rms_norm", "paged_attention", "silu_mul", "final_norm", "scan"})
SHADOWED = frozenset({"conv"})  # also write a W copy of their fp32 output
PRODUCTS = frozenset({"matmul", "matmul_add", "head"})
F32_WEIGHT_OPS = frozenset({"rope_kv_write", "conv", "scan"})


def shadow(name: str) -> str:
    return name + "/w"


@dataclass(slots=True, frozen=True)
class Layout:
    half: dict[str, bool]  # buffer -> stored in W (shadows included)
    f32_weights: frozenset[str]  # weights uploaded as fp32; the others as W words

    def product_input(self, buffer: str) -> str:
        """The buffer a product reading `buffer` takes: its W copy when it has one."""
        return shadow(buffer) if shadow(buffer) in self.half else buffer


def layout(program) -> Layout:
    half: dict[str, bool] = {}
    for op in program.ops:
        if op.writes:
            stored = op.name in HALF_OUTPUTS
            if half.setdefault(op.writes, stored) != stored:
                raise ValueError(f"buffer {op.writes!r} is written both in W and in fp32")
            if op.name in SHADOWED:
                half[shadow(op.writes)] = True
    out = Layout(half, frozenset())
    f32 = {w for op in program.ops if op.name in F32_WEIGHT_OPS for w in op.weights}
    f32 |= {op.weights[0] for op in program.ops if op.name in PRODUCTS and not half[out.product_input(op.reads[0])]}
    if f32 & {op.weights[0] for op in program.ops if op.name in PRODUCTS and half[out.product_input(op.reads[0])]}:
        raise ValueError("a weight is read both by a 16-bit and by an fp32 product")
    return Layout(half, frozenset(f32))
