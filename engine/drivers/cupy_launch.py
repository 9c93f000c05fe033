"""Kernel launchers for the CuPy driver: one method per kernel of engine/drivers/cuda, which
packs the kernel's arguments (pointers, int32/float32 scalars, grid and block) once for both
launchers:

- `DeviceLauncher` loads the NVRTC cubin (engine/drivers/cuda/compile.py), or on ROCm the
  code object hiprtc builds for the device (cuda/compile_hip.py), into CuPy and launches by
  name; the products go to cuBLAS or hipBLAS (GemmEx: 16-bit operands, fp32 out).
- `ReferenceLauncher` takes the same packed arguments, checks them against the kernel's
  signature in the .cu source (count, pointer dtypes, scalar types), reads the pointers as
  the kernel does (flat, sized by the grid and the scalars) and runs reference.py's
  function; the products run in float32 from the same column-major GEMM arguments. With
  NumPy standing in for CuPy this runs the whole driver on a CPU, packing included.
"""

from __future__ import annotations

import re
from functools import cache

import numpy as np

from . import cupy_device
from .cuda import compile as cc
from .cuda import reference as ref

i32, f32 = np.int32, np.float32
# cuBLAS's ABI values (cublas_api.h, library_types.h), named here so that packing a GEMM
# needs no cuBLAS library on the machine.
OP_N, OP_T = 0, 1
CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF = 0, 2, 14
CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT = 68, -1
W_TYPE = {"f16": CUDA_R_16F, "bf16": CUDA_R_16BF}


def w_dtype(wtype: str) -> np.dtype:
    """The array dtype of a 16-bit word type: fp16 as float16, bf16 as raw uint16 words."""
    return np.dtype(np.float16 if wtype == "f16" else np.uint16)


class Launcher:
    """Packs each kernel's launch; `launch` and `gemm` are the launcher's own."""

    def __init__(self, wtype: str, lanes: int = cc.CUDA_LANES):
        """`lanes`: the device's warp (CUDA, 32) or wavefront (HIP, 64 or 32) size, which the
        kernels are built for and the lane-shaped kernels' blocks are sized by."""
        if wtype not in W_TYPE:
            raise ValueError(f"no kernels for word type {wtype!r}")
        self.wtype, self.lanes = wtype, lanes

    def names(self) -> list[str]:
        """The kernels a step may launch: this word type's and the shared ones."""
        return [n for n in cc.kernel_names() if not re.search(r"_(f16|bf16)$", n) or n.endswith("_" + self.wtype)]

    def w(self, base: str) -> str:
        """The name of a kernel that comes once per word type."""
        return f"{base}_{self.wtype}"

    def launch(self, name: str, grid: tuple, block: tuple, args: tuple) -> None:
        raise NotImplementedError

    def gemm(self, transa: int, transb: int, m: int, n: int, k: int, alpha: float, a, lda: int, b, ldb: int,
             beta: float, c, ldc: int) -> None:
        """C (m x n, column-major, ldc) = alpha op(A) op(B) + beta C, as cublasGemmEx."""
        raise NotImplementedError

    def _kernel(self, name: str, grid: tuple, args: tuple) -> None:
        if not all(grid):  # nothing to compute (a step with no logits); a zero grid is refused
            return
        self.launch(name, tuple(int(g) for g in grid), (cc.block_threads(name, self.lanes),), args)

    # ---- one method per kernel: grid and arguments as the kernel's comment states --------

    def embed(self, table, tokens, x, t: int, dim: int) -> None:
        self._kernel(self.w("embed"), (t,), (table, tokens, x, i32(dim)))

    def rms_norm(self, x, h, t: int, dim: int, eps: float) -> None:
        self._kernel(self.w("rms_norm"), (t,), (x, h, i32(dim), f32(eps)))

    def final_norm(self, x, logit_idx, weight, h, n: int, dim: int, eps: float) -> None:
        self._kernel(self.w("final_norm"), (n,), (x, logit_idx, weight, h, i32(dim), f32(eps)))

    def rope_kv_write(self, qkv, rope, positions, kv_slots, q, k_cache, v_cache, t: int, heads: int, kv_heads: int,
                      head_dim: int) -> None:
        self._kernel(self.w("rope_kv_write"), (t,), (qkv, rope, positions, kv_slots, q, k_cache, v_cache, i32(heads),
                                              i32(kv_heads), i32(head_dim)))

    def paged_attention(self, q, k_cache, v_cache, positions, row_slot, tables, out, t: int, heads: int,
                        kv_heads: int, head_dim: int, block_size: int, max_blocks: int) -> None:
        self._kernel(self.w("paged_attention"), (t, heads), (q, k_cache, v_cache, positions, row_slot, tables, out,
                                                     i32(heads), i32(kv_heads), i32(head_dim), i32(block_size),
                                                     i32(max_blocks)))

    def silu_mul(self, gu, act, t: int, inter: int) -> None:
        self._kernel(self.w("silu_mul"), (-(-t * inter // 256),), (gu, act, i32(t), i32(inter)))

    def add(self, x, y, count: int) -> None:
        self._kernel("add_f32", (-(-count // 256),), (x, y, np.int64(count)))

    def pick(self, logits, words, ids, n: int, vocab: int) -> None:
        self._kernel("pick", (n,), (logits, words, ids, i32(vocab)))

    def mamba_conv(self, xz, token_row, row_ids, row_first, conv_w, conv_b, conv_state, xs, xs_w, t: int,
                   d_inner: int, d_conv: int) -> None:
        self._kernel(self.w("mamba_conv"), (-(-d_inner // 128), t), (xz, token_row, row_ids, row_first, conv_w, conv_b,
                                                                     conv_state, xs, xs_w, i32(d_inner), i32(d_conv)))

    def mamba_conv_state(self, xz, row_ids, row_first, row_tokens, conv_state, r: int, d_inner: int,
                         d_conv: int) -> None:
        self._kernel("mamba_conv_state_f32", (-(-d_inner // 128), r), (xz, row_ids, row_first, row_tokens, conv_state,
                                                                       i32(d_inner), i32(d_conv)))

    def mamba_scan(self, xs, dbc, dtr, xz, row_ids, row_first, row_tokens, dt_bias, a, d_skip, ssm_state, y, r: int,
                   d_inner: int, d_state: int, dt_rank: int, dbc_stride: int) -> None:
        self._kernel(self.w("mamba_scan"), (-(-d_inner // 64), r), (xs, dbc, dtr, xz, row_ids, row_first, row_tokens,
                                                                    dt_bias, a, d_skip, ssm_state, y, i32(d_inner),
                                                                    i32(d_state), i32(dt_rank), i32(dbc_stride)))

    def product(self, w, a, y, t: int, accumulate: bool = False) -> None:
        """y[:t, :O] (+)= a[:t, :K] @ w.T for w (O, K) and a (rows, >= K) both in W (or both
        fp32), y (rows, >= O) in fp32, all row-major. Column-major, that is C (O x t) = W^T' B: A is w read as
        (K x O) with lda K and transposed, B is a read as (K x t) with ldb a's row width."""
        out_rows, k = w.shape
        if not t:
            return
        self.gemm(OP_T, OP_N, out_rows, t, k, 1.0, w, k, a, a.shape[-1], 1.0 if accumulate else 0.0, y,
                  y.shape[-1])


# ---- the kernels' signatures, from the sources ---------------------------------------------------

_MACRO = re.compile(r"(\w+)_##SUFFIX\(([^)]*)\)")
_EXTERN = re.compile(r'extern "C" __global__ void(?:\s+__launch_bounds__\([^)]*\))?\s+(?!__launch_bounds__)(\w+)\(([^)]*)\)')
_POINTERS = {"W": None, "float": np.dtype(np.float32), "int": np.dtype(np.int32), "unsigned": np.dtype(np.uint32)}
_SCALARS = {"int": np.int32, "float": np.float32, "long long": np.int64, "unsigned": np.uint32}


def _params(text: str) -> list[tuple[str, bool]]:
    """(C type, is pointer) of each parameter."""
    out = []
    for p in text.replace("\\", " ").split(","):
        words = p.replace("*", " * ").split()
        pointer = "*" in words
        words = [w for w in words[:-1] if w not in ("const", "*")]  # the type, without the name
        out.append((" ".join(words), pointer))
    return out


@cache
def signatures() -> dict[str, list[tuple[str, bool]]]:
    """Every entry point's parameters, the macro's per word type (W stays W)."""
    out = {}
    for source in cc.SOURCES:
        code = cc.source(source).replace("\\\n", " ")
        for name, params in _EXTERN.findall(code):
            out[name] = _params(params)
        for suffix in re.findall(r"^[A-Z]+_KERNELS\((\w+),", code, re.M):
            for name, params in _MACRO.findall(code):
                out[f"{name}_{suffix}"] = _params(params)
    return out


class ReferenceLauncher(Launcher):
    """The kernels as reference.py computes them, on NumPy arrays, from the packed arguments."""

    def __init__(self, wtype: str, lanes: int = cc.CUDA_LANES):
        super().__init__(wtype, lanes)
        self.launches: list[str] = []  # every launch's kernel name, in order (tests read it)
        self._f32: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # weight id -> (weight, float32 copy)

    def launch(self, name: str, grid: tuple, block: tuple, args: tuple) -> None:
        self._check(name, block, args)
        self.launches.append(name)
        base = re.sub(r"_(f16|bf16)$", "", name)
        getattr(self, "_ref_" + base)(grid, *args)

    def _check(self, name: str, block: tuple, args: tuple) -> None:
        params = signatures().get(name)
        if params is None:
            raise KeyError(f"no kernel {name!r} in {', '.join(cc.SOURCES)}")
        bound = cc.launch_bounds(self.lanes)[name]
        if block != (bound,):
            raise ValueError(f"{name}: block {block}, its launch bounds at {self.lanes} lanes say {bound}")
        if len(args) != len(params):
            raise TypeError(f"{name}: {len(args)} arguments for {len(params)} parameters")
        for i, (arg, (ctype, pointer)) in enumerate(zip(args, params, strict=True)):
            if pointer:
                want = w_dtype(self.wtype) if ctype == "W" else _POINTERS[ctype]
                if not isinstance(arg, np.ndarray) or arg.dtype != want or not arg.flags.c_contiguous:
                    raise TypeError(f"{name} argument {i}: wants a contiguous {want} array, got "
                                    f"{getattr(arg, 'dtype', type(arg).__name__)}")
            elif type(arg) is not _SCALARS[ctype]:
                raise TypeError(f"{name} argument {i}: wants {_SCALARS[ctype].__name__}, got {type(arg).__name__}")

    # Each kernel's pointers read flat, as the kernel indexes them.
    @staticmethod
    def _rows(a: np.ndarray, n: int, width: int) -> np.ndarray:
        return a.reshape(-1)[: n * width].reshape(n, width)

    def _ref_embed(self, grid, table, tokens, x, dim):
        t = grid[0]
        self._rows(x, t, dim)[:] = ref.embed(table.reshape(-1, dim), tokens[:t])

    def _ref_rms_norm(self, grid, x, h, dim, eps):
        t = grid[0]
        self._rows(h, t, dim)[:] = ref.rms_norm(self._rows(x, t, dim), eps, self.wtype)

    def _ref_final_norm(self, grid, x, logit_idx, weight, h, dim, eps):
        n = grid[0]
        rows = logit_idx[:n]
        x2 = self._rows(x, int(rows.max()) + 1 if n else 0, dim)
        self._rows(h, n, dim)[:] = ref.rms_norm(x2, eps, self.wtype, rows, weight.reshape(-1)[:dim])

    def _ref_rope_kv_write(self, grid, qkv, rope, positions, kv_slots, q, k_cache, v_cache, heads, kv_heads,
                           head_dim):
        t, width = grid[0], (heads + 2 * kv_heads) * head_dim
        kc, vc = k_cache.reshape(-1, kv_heads, head_dim), v_cache.reshape(-1, kv_heads, head_dim)
        rot = ref.rope_kv_write(self._rows(qkv, t, width), rope.reshape(-1, head_dim // 2, 2), positions[:t],
                                kv_slots[:t], kc, vc, int(heads), int(kv_heads), int(head_dim))
        self._rows(q, t, heads * head_dim)[:] = rot

    def _ref_paged_attention(self, grid, q, k_cache, v_cache, positions, row_slot, tables, out, heads, kv_heads,
                             head_dim, block_size, max_blocks):
        t = grid[0]
        if grid[1:] != (heads,):
            raise ValueError(f"paged_attention: grid {grid}, wants (tokens, {heads})")
        kc, vc = k_cache.reshape(-1, kv_heads, head_dim), v_cache.reshape(-1, kv_heads, head_dim)
        got = ref.paged_attention(self._rows(q, t, heads * head_dim), kc, vc, positions[:t], row_slot[:t],
                                  tables.reshape(-1, max_blocks), int(heads), int(kv_heads), int(head_dim),
                                  int(block_size))
        self._rows(out, t, heads * head_dim)[:] = got

    def _ref_silu_mul(self, grid, gu, act, tokens, inter):
        if grid[0] * 256 < tokens * inter:
            raise ValueError(f"silu_mul: grid {grid} covers fewer than {tokens} x {inter} outputs")
        self._rows(act, tokens, inter)[:] = ref.silu_mul(self._rows(gu, tokens, 2 * inter), self.wtype)

    def _ref_add_f32(self, grid, x, y, count):
        x.reshape(-1)[:count] += y.reshape(-1)[:count]

    def _ref_pick(self, grid, logits, words, ids, vocab):
        n = grid[0]
        z = self._rows(logits, n, vocab)
        got, z[:] = ref.pick(z, self._rows(words, n, 8))
        ids[:n] = got

    def _ref_mamba_conv(self, grid, xz, token_row, row_ids, row_first, conv_w, conv_b, conv_state, xs, xs_w, d_inner,
                        d_conv):
        t = grid[1]
        rows = token_row[:t]
        r = int(rows[-1]) + 1
        counts = np.bincount(rows, minlength=r).astype(np.int32)
        got, got_w = ref.mamba_conv(self._rows(xz, t, 2 * d_inner), rows, row_ids[:r], row_first[:r], counts,
                                    conv_w.reshape(d_inner, d_conv), conv_b[:d_inner],
                                    conv_state.reshape(-1, d_conv - 1, d_inner), self.wtype)
        self._rows(xs, t, d_inner)[:], self._rows(xs_w, t, d_inner)[:] = got, got_w

    def _ref_mamba_conv_state_f32(self, grid, xz, row_ids, row_first, row_tokens, conv_state, d_inner, d_conv):
        r = grid[1]
        t = int(row_first[r - 1] + row_tokens[r - 1])
        ref.mamba_conv_state(self._rows(xz, t, 2 * d_inner), row_ids[:r], row_first[:r], row_tokens[:r],
                             conv_state.reshape(-1, d_conv - 1, d_inner))

    def _ref_mamba_scan(self, grid, xs, dbc, dtr, xz, row_ids, row_first, row_tokens, dt_bias, a, d_skip, ssm_state, y,
                        d_inner, d_state, dt_rank, dbc_stride):
        r = grid[1]
        t = int(row_first[r - 1] + row_tokens[r - 1])
        got = ref.mamba_scan(self._rows(xs, t, d_inner), self._rows(dbc, t, dbc_stride), self._rows(dtr, t, d_inner),
                             self._rows(xz, t, 2 * d_inner), row_ids[:r], row_first[:r], row_tokens[:r],
                             dt_bias[:d_inner], a.reshape(d_inner, d_state), d_skip[:d_inner],
                             ssm_state.reshape(-1, d_inner, d_state), int(dt_rank), self.wtype)
        self._rows(y, t, d_inner)[:] = got

    def _as_f32(self, a: np.ndarray) -> np.ndarray:
        """A weight's float32 values, converted once."""
        held = self._f32.get(id(a))
        if held is None or held[0] is not a:
            held = self._f32[id(a)] = (a, ref.w_to_f32(a))
        return held[1]

    def gemm(self, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
        if (transa, transb) != (OP_T, OP_N):
            raise NotImplementedError("the driver's products are op(A) = A^T, op(B) = B")
        operand = np.dtype(np.float32) if a.dtype == np.float32 else w_dtype(self.wtype)
        for what, arr, dtype in (("A", a, operand), ("B", b, operand), ("C", c, np.float32)):
            if arr.dtype != dtype or not arr.flags.c_contiguous:
                raise TypeError(f"gemm {what}: wants a contiguous {dtype} array, got {arr.dtype}")
        # Column-major A (k x m, lda) transposed is row-major (m, lda)[:, :k]; likewise B, C.
        wa = self._as_f32(a).reshape(-1)[: m * lda].reshape(m, lda)[:, :k]
        wb = ref.w_to_f32(b.reshape(-1)[: n * ldb].reshape(n, ldb)[:, :k])
        out = c.reshape(-1)[: n * ldc].reshape(n, ldc)[:, :m]
        y = f32(alpha) * (wb @ wa.T)
        out[:] = y if beta == 0 else y + f32(beta) * out  # beta 0: C is not read (cuBLAS's rule)


class DeviceLauncher(Launcher):
    """The kernels through CuPy (every one of `names()` loaded here, once), the products
    through cuBLAS, or on ROCm through hipBLAS, which CuPy's cuBLAS calls reach there."""

    def __init__(self, wtype: str, lanes: int = cc.CUDA_LANES):
        super().__init__(wtype, lanes)
        import tempfile
        from pathlib import Path

        import cupy
        from cupy_backends.cuda.libs import cublas

        self.cp, self.cublas = cupy, cublas
        self.hip = bool(cupy.cuda.runtime.is_hip)
        if self.hip and wtype == "bf16":
            # CuPy's hipBLAS layer converts fp16 and fp32 operand types only (cupy_hipblas.h).
            raise ValueError("the rocm driver multiplies fp16 words only (CuPy's hipBLAS calls take no bf16 "
                             "operands), and this model has a weight past fp16's range")
        self.errors = cupy_device.cuda_errors()
        wanted = set(self.names())
        self.functions = {}
        with tempfile.TemporaryDirectory() as folder:
            for source, (suffix, binary) in self._binaries().items():
                path = Path(folder) / (source + suffix)
                path.write_bytes(binary)
                module = cupy.RawModule(path=str(path))
                for name in cc.kernel_names(source):
                    if name in wanted:
                        self.functions[name] = module.get_function(name)  # loads the module now
        # alpha and beta live on the host (CUBLAS_POINTER_MODE_HOST), as float32 for COMPUTE_32F.
        self._scalars = {v: np.array(v, np.float32) for v in (0.0, 1.0)}

    def _binaries(self) -> dict[str, tuple[str, bytes]]:
        """Each source's file suffix and binary for this device."""
        if self.hip:  # hiprtc, for the device's own architecture and wavefront
            from .cuda import compile_hip

            arch = cupy_device.gcn_arch(self.cp)
            return {source: (".hsaco", compile_hip.compile_on_device(source, arch, self.lanes))
                    for source in cc.SOURCES}
        # Hopper loads the sm_90 cubin; a later GPU has the driver JIT-compile the compute_90 PTX.
        hopper = int(self.cp.cuda.Device().compute_capability) // 10 == 9
        return {source: (".cubin", unit.cubin) if hopper else (".ptx", unit.ptx.encode())
                for source, unit in cc.compile_all().items()}

    def launch(self, name: str, grid: tuple, block: tuple, args: tuple) -> None:
        try:
            self.functions[name](grid, block, args)
        except self.errors as e:
            if cupy_device.refused(e):  # refused at the launch call: the kernel never ran
                raise cupy_device.LaunchRefused(f"{name} grid {grid} block {block}: {e}") from e
            raise

    def gemm(self, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
        cublas = self.cublas
        handle = self.cp.cuda.device.get_cublas_handle()
        cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
        wt = CUDA_R_32F if a.dtype == np.float32 else W_TYPE[self.wtype]  # A and B: one type
        # CuPy's hipBLAS layer takes the compute type as a data type (fp32: CUDA_R_32F).
        compute = CUDA_R_32F if self.hip else CUBLAS_COMPUTE_32F
        cublas.gemmEx(handle, transa, transb, m, n, k, self._scalars[alpha].ctypes.data, a.data.ptr, wt, lda,
                      b.data.ptr, wt, ldb, self._scalars[beta].ctypes.data, c.data.ptr, CUDA_R_32F, ldc,
                      compute, CUBLAS_GEMM_DEFAULT)
