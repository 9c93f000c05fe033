"""Compiled CPU kernels (numba) for the places where NumPy and OpenBLAS leave the most time
on the table in a decode step:

- few_token_matmul: W @ X for 1 to 12 tokens. OpenBLAS runs 2- to 12-token products at a
  third to a half of memory speed (on SmolLM2 the products of a 2-token step took 1.9x
  those of a 1-token step); this kernel reads each weight row once and dots it with every
  token while it sits in L1 (1.25x).
  Speculative verification and small batches live in this range. One-token products use it
  too, so that a few-token step runs on one thread pool: numba's and OpenBLAS's threads
  each spin for a while after their work, and alternating between them on two cores made a
  one-row step several times slower.
- paged_attention: every fed token attends its own row's keys in place, block by block
  through the row's block table, with an online softmax: no gathered copy of the context
  (the copy was most of a many-row step's attention), no per-row Python loop. A decode
  token scores a block's 16 keys as one vector per head (cpu_attention_kernels). A row fed
  several tokens (a prompt chunk, the few uncached tokens of a prefix-cache hit, speculative
  verification) goes in tiles of 16 query vectors that read each key once
  (cpu_attention_kernels): 2-4x the one-query-at-a-time loop, and 1.3-2x causal tiles of MKL
  products over a gathered copy, at 2 to 512 tokens against 16 to 2,048 keys.
- rms_scale, rope_store, silu_mul: the glue between a step's products (norm, rotary with the
  KV write, SiLU times up), one call each instead of several NumPy passes; split across
  threads when a step has many tokens.

LLVM has no vector exp here (numba's SVML path needs Intel's patched LLVM), so the kernels
use their own: a float32 Cephes-style polynomial whose 2^n is built from exponent bits,
which vectorizes (about 10x a scalar libm call per element).

All are compiled once, when the driver prepares (`compile()`; the driver counts each
build), for the only types a step uses (float32 values, int64 indices), and cached on disk
by numba. Without numba (or without a thread-safe threading layer) `available()` is False
and the driver keeps its NumPy path: same results, slower.
"""

from __future__ import annotations

import threading
import time
from typing import NamedTuple

import numpy as np

from . import cpu_block_products, mkl_products

FEW_TOKENS = range(1, 13)  # token counts few_token_matmul takes over from BLAS (measured crossover)
# Multiply-adds below which a kernel runs on the calling thread alone: waking numba's
# workers costs more than it saves, and a woken worker spins on a core for a while after
# (a tiny model's steps would keep a second core busy for nothing).
PARALLEL_MIN_WORK = 1 << 17
GLUE_PARALLEL_MIN = 1 << 15  # elements below which a glue kernel (norm, rotary, SiLU, softmax) runs serially
TOKEN_RUN = 64  # most tokens per run of a parallel glue kernel: inner loops long enough to vectorize
# OpenBLAS's worker threads spin for about this long after a product (2^28 cycles, its
# default THREAD_TIMEOUT). A numba team started meanwhile shares a core with the spinner
# and waits for it at every barrier: measured on SmolLM2, the one-token step right after a
# prefill chunk took 2.7x its usual time that way, 1.7x on the calling thread alone.
BLAS_SPIN_S = 0.1


_kernels = None
_error: str | None = None
_numba = None  # the numba module, once the kernels are built
_last_blas = 0.0  # time.monotonic() of the last product left to OpenBLAS
_threads_set = threading.local()  # the numba thread count this thread last set


def _build():
    global _numba
    import numba

    _numba = numba
    _prefer_wide_vectors(numba)
    # The engine thread and test threads may launch kernels concurrently: the default
    # workqueue layer aborts on that, so ask for a thread-safe one, OpenMP first: MKL's
    # products run on GNU OpenMP too (mkl_products), and one pool never waits for the other.
    numba.config.THREADING_LAYER = "threadsafe"
    numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]

    from . import cpu_attention_kernels as att
    from . import cpu_kernels_numba as nb

    return KernelSet(nb.few_token_matmul, att.paged_attention, nb.rms_scale, nb.silu_mul, nb.rope_store,
                     nb.rms_run, nb.silu_rows, nb.rope_run)


class KernelSet(NamedTuple):
    """The compiled kernels the driver calls, by name."""

    few_token_matmul: object
    paged_attention: object
    rms_scale: object
    silu_mul: object
    rope_store: object
    rms_run: object
    silu_rows: object
    rope_run: object


def _prefer_wide_vectors(numba) -> None:
    """Lets LLVM use the host's widest vectors. For AVX-512 hosts it prefers 256-bit ones by
    default (older chips slowed their clock for 512-bit work); here the few-token products
    ran 1.3-1.7x faster with 512-bit vectors and single-threaded paged attention 1.4x.
    With VNNI, it also asks for vpdpwssd as one instruction: LLVM's tuning for Intel cores
    (rocketlake, as a Xeon VM reported itself, and sapphirerapids; not znver4) splits it into
    vpmaddwd + vpaddd, which compete for the same two vector ports; the multi-token integer
    products ran 1.5x faster fused (SmolLM2's 32-row products 70 against 43 ms).
    Applies only if nothing in the process compiled with numba before (the target is set
    up once); numba's on-disk cache keys its entries by these features."""
    if numba.config.CPU_NAME is None and numba.config.CPU_FEATURES is None:
        import llvmlite.binding as llvm

        features = llvm.get_host_cpu_features().flatten()
        have = features.split(",")
        if "+avx512f" in have:
            numba.config.CPU_NAME = llvm.get_host_cpu_name()
            tuning = ",-prefer-256-bit" + (",+fast-dpwssd" if "+avx512vnni" in have else "")
            numba.config.CPU_FEATURES = features + tuning


def compile() -> int:
    """Builds (or loads from numba's cache) every kernel, once per process, and runs each on
    a tiny input of the step's types; returns how many kernels there are. Raises
    RuntimeError when they cannot be built here."""
    global _kernels, _error
    if _kernels is None and _error is None:
        try:
            kernels = _build()
            _smoke(*kernels)
            _kernels = kernels
        except Exception as exc:  # no numba, no thread-safe layer, a compiler failure
            _error = f"{type(exc).__name__}: {exc}".splitlines()[0]
    if _kernels is None:
        raise RuntimeError(f"the CPU kernels are unavailable ({_error})")
    return len(_kernels)


def _smoke(few_token_matmul, paged_attention, rms_scale, silu_mul, rope_store, rms_run, silu_rows, rope_run) -> None:
    w = np.ones((3, 2), np.float32)
    out = np.empty((3, 2), np.float32)
    few_token_matmul(w, np.ones((2, 2), np.float32), out)
    cache = np.ones((2, 1, 1, 2, 2), np.float32)
    att = np.empty((1, 2), np.float32)
    paged_attention(np.ones((1, 1, 2), np.float32), cache, np.zeros((1, 1), np.int64), np.zeros(1, np.int64),
                    np.ones(1, np.int64), att)
    norm = np.empty((2, 1), np.float32)
    rms_scale(np.full((2, 1), 2, np.float32), np.float32(0), norm, 1)
    act = np.empty((1, 1), np.float32)
    silu_mul(np.zeros((2, 1), np.float32), act)
    q = np.empty((1, 1, 2), np.float32)
    rope_store(np.ones((6, 1), np.float32), np.array([[0, 1]], np.float32), np.zeros(1, np.int64),
               np.zeros(1, np.int64), cache, q, 1)
    # The serial entry points, on the types the wrappers pass.
    serial_norm, serial_act = np.empty((2, 1), np.float32), np.empty((1, 1), np.float32)
    rms_run(np.full((2, 1), 2, np.float32), np.float32(0), serial_norm, 0, 1)
    silu_rows(np.zeros((2, 1), np.float32), serial_act, 0, 1)
    rope_run(np.ones((6, 1), np.float32), np.array([[0, 1]], np.float32), np.zeros(1, np.int64),
             np.zeros(1, np.int64), cache, q, 0, 1)
    if not (np.all(out == 2) and np.allclose(att, 1) and np.allclose(norm, 1) and act[0, 0] == 0
            and np.allclose(q, [[[-1, 1]]]) and np.allclose(serial_norm, 1) and serial_act[0, 0] == 0):
        raise RuntimeError("the compiled kernels gave wrong results on a known input")


def specializations() -> int:
    """Machine-code versions built so far, over every kernel: numba builds one per argument
    type signature, so a step passing an unexpected type (a read-only or strided array)
    would compile again. The driver reports any growth as a compile."""
    return sum(len(k.signatures) for k in _kernels) if _kernels is not None else 0


def int8_supported() -> bool:
    """Whether this CPU runs the integer block products (cpu_int8_kernels: AVX-512 VNNI), on
    the features numba compiles for."""
    try:
        compile()
    except RuntimeError:
        return False
    import llvmlite.binding as llvm

    from . import cpu_int8_kernels  # after compile(): numba's target is chosen by then

    return cpu_int8_kernels.supported(_numba.config.CPU_FEATURES or llvm.get_host_cpu_features().flatten())


def available() -> bool:
    try:
        compile()
    except RuntimeError:
        return False
    return True


def unavailable_reason() -> str:
    return "" if available() else f"CPU kernels unavailable: {_error}"


def matmul(w: np.ndarray, x: np.ndarray, packed=None) -> np.ndarray:
    """w (o, i) @ x (i, T), feature-major like every product of the forward. `packed`: w in
    MKL's packed layout (mkl_products.PackedWeight), used for more than FEW_TOKENS tokens."""
    global _last_blas
    tokens = x.shape[1]
    large = w.size * tokens >= PARALLEL_MIN_WORK
    if tokens not in FEW_TOKENS or _kernels is None:
        if packed is not None:
            return mkl_products.matmul(packed, x)
        if large:  # OpenBLAS runs it on its threads, which then spin for a while
            _last_blas = time.monotonic()
        return w @ x
    out = np.empty((w.shape[0], tokens), dtype=np.float32)
    _set_threads(large)
    _kernels.few_token_matmul(w, np.ascontiguousarray(x.T), out)
    return out


def _rows_of(a: np.ndarray) -> np.ndarray:
    """A C-contiguous array whose leading columns are `a`, for kernels that read only the
    columns they are told: `a` itself, or the array it is the leading columns of (MKL's
    products return such a view of their padded result). Passing views would make numba
    build a second, strided version of the kernel in the middle of serving."""
    if a.flags.c_contiguous:
        return a
    base = a.base
    if (isinstance(base, np.ndarray) and base.flags.c_contiguous and base.ndim == 2 and base.dtype == a.dtype
            and base.shape[0] == a.shape[0] and base.shape[1] >= a.shape[1] and a.strides == base.strides
            and a.ctypes.data == base.ctypes.data):
        return base
    return np.ascontiguousarray(a)


def run_length(tokens: int, threads: int) -> int:
    """Tokens per run of the parallel glue kernels: the runs come in a multiple of the thread
    count, at most TOKEN_RUN each (runs of a flat 64 gave one of two threads 128 of a
    176-token chunk's tokens and the other 48)."""
    runs = threads * -(-tokens // (threads * TOKEN_RUN))
    return -(-tokens // runs)


def rms_scale(x: np.ndarray, eps: float) -> np.ndarray:
    """x / rms(x) per token of a feature-major (features, T) float32 array."""
    out = np.empty_like(x)
    if x.size >= GLUE_PARALLEL_MIN:
        _set_threads(True)
        _kernels.rms_scale(x, np.float32(eps), out, run_length(x.shape[1], _numba.get_num_threads()))
    else:
        _kernels.rms_run(x, np.float32(eps), out, 0, x.shape[1])
    return out


def silu_mul(gate_up: np.ndarray) -> np.ndarray:
    """silu(gate) * up for a feature-major (2 inter, T) array of gate rows then up rows."""
    out = np.empty((gate_up.shape[0] // 2, gate_up.shape[1]), np.float32)
    if gate_up.size >= GLUE_PARALLEL_MIN:
        _set_threads(True)
        _kernels.silu_mul(_rows_of(gate_up), out)
    else:
        _kernels.silu_rows(_rows_of(gate_up), out, 0, out.shape[0])
    return out


def rope_store(qkv, rope, block, offset, cache, heads: int) -> np.ndarray:
    """Rotary on Q and K, K and V written to the paged cache; returns Q (T, heads, hd)."""
    q = np.empty((qkv.shape[1], heads, cache.shape[4]), np.float32)
    if qkv.size >= GLUE_PARALLEL_MIN:
        _set_threads(True)
        _kernels.rope_store(_rows_of(qkv), rope, block, offset, cache, q, run_length(q.shape[0], _numba.get_num_threads()))
    else:
        _kernels.rope_run(_rows_of(qkv), rope, block, offset, cache, q, 0, q.shape[0])
    return q


def paged_attention(q, cache, tables, table_of, lengths, out, tokens: int = 1, shared_pool: bool = False) -> None:
    """See _build(); every array must already have the step's types (float32, int64).
    `tokens`: the step's fed tokens. A few-token step runs entirely on numba's threads; so
    does a larger one whose products run on the same pool (`shared_pool`: MKL on OpenMP);
    otherwise the second core is left to OpenBLAS, whose threads spin between products.
    A short context's attention still runs on the whole pool: switching numba's thread count
    down and back around it, twice a layer, cost a one-row step more (7.69 against 8.05 ms,
    steps interleaved in one run, contexts of 10-160 tokens)."""
    _set_threads(shared_pool or tokens in FEW_TOKENS)
    _kernels.paged_attention(q, cache, tables, table_of, lengths, out)


def _set_threads(parallel: bool) -> None:
    if parallel and time.monotonic() - _last_blas < BLAS_SPIN_S:
        parallel = False
    threads = _numba.config.NUMBA_NUM_THREADS if parallel else 1
    # numba's setting is the calling thread's own; setting it costs ~4 us, a step asks ~1,500 times.
    if getattr(_threads_set, "n", None) != threads:
        _numba.set_num_threads(threads)
        _threads_set.n = threads


class Kernels:
    """The kernels as one prepared model uses them: the module's functions, with the model's
    large weights packed once for MKL (when it is available) so that every product of more
    than FEW_TOKENS tokens runs there, and every product and kernel of a step on one OpenMP
    pool. Without MKL, those products stay on NumPy's BLAS."""

    FEW_TOKENS = FEW_TOKENS
    rms_scale = staticmethod(rms_scale)
    silu_mul = staticmethod(silu_mul)
    rope_store = staticmethod(rope_store)

    @staticmethod
    def specializations() -> int:
        return specializations() + cpu_block_products.specializations()

    def __init__(self, weights, use_mkl: bool = True, head: np.ndarray | None = None, codes=(), int8: bool = True):
        """`head`: the output matrix, packed to give token-major logits (see head()).
        `codes`: (matrix, BlockCodes, colscale or None) for the matrices whose products run
        on block codes (cpu_block_products), on the paths this machine has: integer dot
        products where the CPU has VNNI (and `int8`), MKL where installed (and `use_mkl`)."""
        compile()
        self._packed: dict[int, tuple[np.ndarray, mkl_products.PackedWeight]] = {}
        # MKL runs on the OpenMP pool numba's kernels use: where it is loaded, the step's
        # attention products run there too, and no OpenBLAS thread spins beside the pool.
        self._mkl = use_mkl and mkl_products.available()
        paths = tuple(p for p in cpu_block_products.PATHS
                      if (p != "int8" or (int8 and int8_supported())) and (p != "mkl" or use_mkl))
        if codes:
            cpu_block_products.compile(int8="int8" in paths)
        self._blocks: dict[int, tuple[np.ndarray, cpu_block_products.BlockProduct]] = {
            id(w): (w, cpu_block_products.BlockProduct(c, scale, paths, head=w is head)) for w, c, scale in codes}
        self.choices: list = []  # cpu_product_choice.ShapeChoice, once measure() has run
        self.measure_seconds = 0.0
        if use_mkl and mkl_products.available():
            for w in [*weights, *([] if head is None else [head])]:
                if w.ndim == 2 and w.size >= mkl_products.MIN_PACKED_WEIGHTS and id(w) not in self._blocks:
                    # Keyed by identity; holding w keeps its id from being reused.
                    self._packed[id(w)] = (w, mkl_products.PackedWeight(w, right=w is head))

    @property
    def packed(self) -> int:
        """How many float32 weight matrices run on MKL's packed products."""
        return len(self._packed)

    @property
    def blocks(self) -> int:
        """How many weight matrices run their products on block codes."""
        return len(self._blocks)

    def measure(self, max_tokens: int, head_tokens: int) -> list:
        """Times each block product's paths for steps of up to `max_tokens` tokens (the head:
        `head_tokens`) and keeps the fastest per shape and token count (cpu_product_choice);
        returns the measurements."""
        from . import cpu_product_choice

        products = [product for _, product in self._blocks.values()]
        start = time.perf_counter()
        self.choices = cpu_product_choice.choose(products, max_tokens, head_tokens, self._run_block,
                                                 lambda: time.sleep(BLAS_SPIN_S))
        self.measure_seconds = time.perf_counter() - start
        return self.choices

    def _packed_of(self, w: np.ndarray):
        entry = self._packed.get(id(w))
        return entry[1] if entry is not None and entry[0] is w else None

    def block_product(self, w: np.ndarray):
        """The BlockProduct w's products run on, or None (w is not on block codes)."""
        entry = self._blocks.get(id(w))
        return entry[1] if entry is not None and entry[0] is w else None

    @staticmethod
    def _run_block(product, path: str, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """A block product on `path`, numba's threads set as for the product's work (its input
        is quantized on them whatever the path)."""
        global _last_blas
        tokens = x.shape[1]
        _set_threads(product.work(tokens) >= PARALLEL_MIN_WORK)
        result = product.run(path, x, out)
        if path == "openblas" and product.work(tokens) >= PARALLEL_MIN_WORK:
            _last_blas = time.monotonic()
        return result

    def matmul(self, w: np.ndarray, x: np.ndarray) -> np.ndarray:
        block = self.block_product(w)
        if block is not None:
            result = self._run_block(block, block.path_for(x.shape[1]), x)
            return result.T if block.head else result
        packed = self._packed_of(w)
        if packed is not None and packed.right:
            return self.head(w, x).T
        return matmul(w, x, packed)

    def head(self, w: np.ndarray, x: np.ndarray) -> np.ndarray:
        """(w @ x).T as a C-contiguous (T, o) array: the logits, one row per token. The head
        packed as MKL's right-hand matrix writes them so (at 32 rows, transposing 32 x 49152
        logits took 9 ms, 8% of the step)."""
        block = self.block_product(w)
        if block is not None:
            result = self._run_block(block, block.path_for(x.shape[1]), x)
            return result if block.head else np.ascontiguousarray(result.T)
        packed = self._packed_of(w)
        if packed is not None and packed.right and x.shape[1] not in FEW_TOKENS:
            return mkl_products.matmul_token_major(packed, x)
        return np.ascontiguousarray(matmul(w, x).T)

    def matmul_add(self, w: np.ndarray, x: np.ndarray, acc: np.ndarray) -> None:
        """acc += w @ x (the residual adds): MKL adds in place, without a result array."""
        block = self.block_product(w)
        if block is not None and not block.head and acc.flags.c_contiguous:
            self._run_block(block, block.path_for(x.shape[1]), x, out=acc)
            return
        packed = self._packed_of(w)
        if packed is not None and not packed.right and x.shape[1] not in FEW_TOKENS:
            mkl_products.matmul_add(packed, x, acc)
        else:
            acc += self.matmul(w, x)

    def paged_attention(self, q, cache, tables, table_of, lengths, out, tokens: int = 1) -> None:
        paged_attention(q, cache, tables, table_of, lengths, out, tokens, shared_pool=self._mkl)

    @staticmethod
    def run_layers(stack, x: np.ndarray, rope: np.ndarray, layout) -> None:
        """A cpu_layers.DecoderStack over the step, on numba's threads as its products would
        run alone (the smallest decides: the glue and attention between them go along)."""
        _set_threads(stack.smallest * x.shape[1] >= PARALLEL_MIN_WORK)
        stack.run(x, rope, layout, _numba.get_num_threads())
