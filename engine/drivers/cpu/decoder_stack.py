"""When the CPU driver runs a program's decoder layers as one compiled call
(kernels/decoder.py's decoder_layers) instead of op by op.

The walk through a program costs a one-row step of SmolLM2 some 270 trips from Python into
compiled code (nine ops a layer, each through a few Python frames): about 1.3 of its 6 ms on
a 2-core Xeon, where its products take 3.7. A program whose layers are all the Llama layer
(engine/models/llama.py's `llama_layer` op, engine/ops.py) with every product on block codes
runs them in one call instead, for the token counts where every layer
product's measured choice is the integer path (products/choice.py), which that call takes.
Anything else, and every other token count, walks the ops as before.
"""

from __future__ import annotations

import numpy as np

from ...ops import Program
from .platform import huge_pages
from .products import ModelProducts
from .products.integer import IntegerPath, integer_path
from .runtime import Runtime

PRODUCTS = ("matmul", "matmul_add")  # the layer's parts decoder_layers takes as products, in order


def layer_span(program: Program) -> tuple[int, int, int] | None:
    """(first op, end op, layers) of the program's run of llama_layer ops, layer i's cache being
    layer i's, when every llama_layer op is in that run; else None."""
    ops = program.ops
    first = next((i for i, op in enumerate(ops) if op.name == "llama_layer"), None)
    if first is None:
        return None
    end = first
    while end < len(ops) and ops[end].name == "llama_layer" and ops[end].layer == end - first:
        end += 1
    if any(op.name == "llama_layer" for op in ops[end:]):
        return None
    return first, end, end - first


class DecoderStack:
    """A program's Llama layers on block codes, ready for kernels/decoder.py: each role's
    products (QKV, output, gate/up, down) with their integer-path arrays stacked over the
    layers, and every layer's cache in one pool, so a step passes a few dozen arrays whatever
    the depth. The products keep running alone on views of the stacks (no second copy).
    `products`: the Products, four a layer; `pool` (layers, ...): the caches."""

    def __init__(self, span: tuple[int, int, int], products: list, pool: np.ndarray, eps: float, heads: int,
                 runtime: Runtime, path: str):
        self.first, self.end, self.layers = span
        self.path = path  # the integer path's name (products/integer.py): the one this process has
        self.products = products
        self.pool = pool
        self.eps, self.heads = np.float32(eps), heads
        self.runtime = runtime
        self.kernel = runtime.kernels.decoder.decoder_layers
        self.roles = tuple(_stacked([p.path(path) for p in products[role::4]]) for role in range(4))
        self.smallest = min(p.shape[0] * p.shape[1] for p in products)  # a token's work in the least product
        self._takes: dict[int, bool] = {}  # by token count: asked every step, fixed once the choice is made

    def takes(self, tokens: int) -> bool:
        """Whether a step of `tokens` tokens runs here: every layer product chose the integer
        path for that many."""
        taken = self._takes.get(tokens)
        if taken is None:
            taken = self._takes[tokens] = all(p.path_for(tokens) == self.path for p in self.products)
        return taken

    def run(self, x: np.ndarray, rope: np.ndarray, layout) -> None:
        """Every layer over the step, x (hidden, T) updated in place, on numba's threads as the
        layers' products would run alone (the smallest decides: the glue and attention between
        them go along)."""
        self.runtime.set_threads_for(self.smallest * x.shape[1])
        self.kernel(x, *self.roles, self.pool, rope, layout.write_block, layout.write_offset, layout.paged_tables,
                    layout.paged_table_of, layout.paged_lengths, self.eps, self.heads, self.runtime.threads())


def _stacked(paths: list[IntegerPath]) -> tuple:
    """One role's integer-path arrays over the layers, (codes, d, m, dw, mw, order, colscale),
    each path moved onto its layer's views of them."""
    def stack(arrays: list[np.ndarray]) -> np.ndarray:
        out = huge_pages.empty((len(arrays), *arrays[0].shape), arrays[0].dtype)
        for layer, a in enumerate(arrays):
            out[layer] = a
        return out

    codes = stack([p.codes for p in paths])
    d, m = (stack([p.scales[k] for p in paths]) for k in (0, 1))
    # Where the lane layout is the block scales themselves (integer_layout.lane_scales), the
    # stack holds them once too.
    dw, mw = (block if all(p.lane_scales[k] is p.scales[k] for p in paths) else stack([p.lane_scales[k] for p in paths])
              for k, block in ((0, d), (1, m)))
    colscale = stack([p.colscale for p in paths])
    for layer, p in enumerate(paths):
        p.share(codes[layer], (d[layer], m[layer]), (dw[layer], mw[layer]), colscale[layer])
    return codes, d, m, dw, mw, paths[0].order, colscale


def decoder_stack(program: Program, products: ModelProducts, pool: np.ndarray | None,
                  runtime: Runtime) -> DecoderStack | None:
    """The program's DecoderStack where it has one: its layers are llama_layer ops, each layer's
    cache is the pool's entry of that index, and every layer product runs on block codes with
    the integer path among its paths, a role's arrays of one type and shape in every layer.
    Else None."""
    span = layer_span(program)
    if span is None or pool is None:
        return None
    first, end, _ = span
    layer_products = []
    for op in program.ops[first:end]:
        names = [part.weights[0] for part in op.parts if part.name in PRODUCTS]
        if len(names) != 4:  # the kernel computes the layer as its parts were when it was written
            raise ValueError(f"layer {op.layer}'s llama_layer op has {len(names)} products; decoder_layers takes 4")
        layer_products += [products.get(name) for name in names]
    kind = integer_path(runtime)
    if kind is None or any(p is None or kind.name not in p.paths or p.head for p in layer_products):
        return None
    paths = [p.path(kind.name) for p in layer_products]
    kinds = [{tuple((a.dtype, a.shape) for a in (p.codes, *p.scales, *p.lane_scales, p.order, p.colscale))
             for p in paths[role::4]} for role in range(4)]
    same_order = all(np.array_equal(p.order, paths[role].order) for role in range(4) for p in paths[role::4])
    layers = [op.layer for op in program.ops[first:end]]
    if any(len(k) != 1 for k in kinds) or not same_order or layers != list(range(len(pool))):
        return None
    return DecoderStack(span, layer_products, pool, program.eps, program.dims["heads"], runtime, kind.name)
