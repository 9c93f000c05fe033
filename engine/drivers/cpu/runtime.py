"""What the CPU driver's compiled code shares in a process, as one object the driver owns
(`Runtime`): numba's build (the target CPU and its features, target.py's choice, the threading
layer, the rule that stamps the kernels' on-disk cache, the known-input check), the thread count each kernel runs
on, and the clock of OpenBLAS's spinning threads.

numba fixes its target and threading layer at a process's first compile, so a process has one
runtime (`shared()`), which every CPU driver of the process is handed unless it is given
another. The kernels are compiled once, when a driver prepares (`compile()`; the driver counts
each build), for the only types a step uses (float32 values, int64 indices), and cached on
disk by numba. Without numba (or without a thread-safe threading layer) `available()` is
False and the driver keeps its NumPy path: same results, slower.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import os
import threading
import time
from typing import NamedTuple

import numpy as np

from ...cache_dir import cache_root
from . import kernels as kernels_folder
from . import target

# Multiply-adds below which a kernel runs on the calling thread alone: waking numba's
# workers costs more than it saves, and a woken worker spins on a core for a while after
# (a tiny model's steps would keep a second core busy for nothing).
PARALLEL_MIN_WORK = 1 << 17
# OpenBLAS's worker threads spin for about this long after a product (2^28 cycles, its
# default THREAD_TIMEOUT). A numba team started meanwhile shares a core with the spinner
# and waits for it at every barrier: measured on SmolLM2, the one-token step right after a
# prefill chunk took 2.7x its usual time that way, 1.7x on the calling thread alone.
BLAS_SPIN_S = 0.1


class KernelModules(NamedTuple):
    """The kernel modules (kernels/, by file name), imported once the runtime has chosen
    numba's target."""

    glue: object
    few_token: object
    attention: object
    quantize: object
    blocks: object
    integer: object
    decoder: object


class StampedLocator:
    """Mixin for numba's source-backed cache locators: a kernel of the rule's folder only,
    stamped by the rule (`rule`: a KernelCacheStamp, set on each subclass)."""

    rule: KernelCacheStamp

    @classmethod
    def from_function(cls, py_func, py_file):
        if os.path.dirname(os.path.abspath(py_file)) != cls.rule.folder:
            return None
        return super().from_function(py_func, py_file)

    def get_source_stamp(self):
        return self.rule.stamp(super().get_source_stamp())


class KernelCacheStamp:
    """The stamp of a kernel's on-disk cache. numba stamps a cached kernel with its own file
    only, but the kernel's machine code holds every kernel and helper it calls (numba links
    them in), from other files of the kernels folder too: editing a callee would leave its
    callers' old code in the cache. Here a kernel of the folder is stamped with its own
    file's stamp and the contents of every file of the folder (`files`), so an edit anywhere
    in it rebuilds them (once); the runtime applies this to each kernel before its first call
    (`apply`). Every other numba function keeps numba's own locators."""

    def __init__(self, folder: str, files: tuple[str, ...] | None = None):
        from numba.core import caching

        self.folder = os.path.abspath(folder)
        self.files = tuple(files) if files is not None else tuple(
            os.path.join(self.folder, f) for f in sorted(os.listdir(self.folder)) if f.endswith(".py"))
        # numba's own order of preference: a NUMBA_CACHE_DIR, beside the source, the user's cache.
        bases = (caching.UserProvidedCacheLocator, caching.InTreeCacheLocator, caching.UserWideCacheLocator)
        self._locators = [type(f"Stamped{base.__name__}", (StampedLocator, base), {"rule": self}) for base in bases]

        class Impl(caching.CompileResultCacheImpl):
            _locator_classes = self._locators

        class Cache(caching.FunctionCache):
            _impl_class = Impl

        self._cache_class = Cache

    def stamp(self, own) -> str:
        digest = hashlib.sha256(repr(own).encode())
        for path in self.files:
            with open(path, "rb") as f:
                digest.update(f.read())
        return digest.hexdigest()

    def locator(self, py_func):
        """The stamped locator `py_func`'s cache would have, as numba picks one; None when the
        rule does not take it (a function outside the folder)."""
        source = inspect.getfile(py_func)
        return next((loc for cls in self._locators if (loc := cls.from_function(py_func, source)) is not None), None)

    def apply(self, kernel) -> None:
        """Gives `kernel` (a numba dispatcher made with cache=True) a cache stamped so."""
        kernel._cache = self._cache_class(kernel.py_func)


class Runtime:
    """The kernels once built (`kernels`, by module), or why they could not be (`error`); the
    CPU features they were built for; numba's thread count; OpenBLAS's spin clock. `isa`: the
    instruction sets to compile for (target.py; None: POOT_CPU_ISA's, else the host's)."""

    def __init__(self, cache_stamp: KernelCacheStamp | None = None, isa: str | None = None):
        self.requested_isa = target.requested(isa)
        self.kernels: KernelModules | None = None
        self.error: str | None = None
        self.numba = None  # the numba module, once the kernels are built
        self._cache_stamp = cache_stamp
        self._cached: list = []  # every kernel with an on-disk cache, once built
        self._entries = 0  # the kernels compile() builds and checks
        self._features: frozenset[str] | None = None
        self._last_blas = 0.0  # time.monotonic() of the last product left to OpenBLAS
        self._threads_set = threading.local()  # the numba thread count this thread last set
        self._lock = threading.Lock()

    # ---- the build ----------------------------------------------------------------------

    def compile(self, progress=None) -> int:
        """Builds (or loads from numba's cache) the kernels every step may call, once, and
        runs each on a tiny input of the step's types; returns how many they are. Raises
        RuntimeError when they cannot be built here. `progress` (engine/progress.py) hears
        which kernel is being built, where this call builds them."""
        with self._lock:
            if self.kernels is None and self.error is None:
                try:
                    if progress is not None:
                        progress.report("compile", "loading numba")
                    kernels = self._build()
                    from .kernels.integer_dot import target_features

                    self._entries = _smoke(kernels, progress, half="+f16c" in target_features())
                    self.kernels = kernels
                except Exception as exc:  # no numba, no thread-safe layer, a compiler failure
                    self.error = f"{type(exc).__name__}: {exc}".splitlines()[0]
        if self.kernels is None:
            raise RuntimeError(f"the CPU kernels are unavailable ({self.error})")
        return self._entries

    def _build(self) -> KernelModules:
        import numba
        from numba.core.caching import FunctionCache

        self.numba = numba
        target.choose(numba, self.requested_isa)
        keep_cache_with_the_engines(numba)
        # The engine thread and test threads may launch kernels concurrently: the default
        # workqueue layer aborts on that, so ask for a thread-safe one, OpenMP first: MKL's
        # products run on GNU OpenMP too (platform/mkl.py), and one pool never waits for the other.
        numba.config.THREADING_LAYER = "threadsafe"
        numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]
        modules = KernelModules(*(importlib.import_module(f"{kernels_folder.__name__}.{name}")
                                  for name in KernelModules._fields))
        stamp = self._cache_stamp or KernelCacheStamp(os.path.dirname(kernels_folder.__file__))
        for module in modules:
            for value in vars(module).values():
                if isinstance(getattr(value, "_cache", None), FunctionCache) and \
                        value.py_func.__module__ == module.__name__:
                    stamp.apply(value)
                    self._cached.append(value)
        return modules

    def available(self, progress=None) -> bool:
        try:
            self.compile(progress)
        except RuntimeError:
            return False
        return True

    def unavailable_reason(self) -> str:
        return "" if self.available() else f"CPU kernels unavailable: {self.error}"

    def features(self) -> frozenset[str]:
        """The CPU features numba compiles for (LLVM's names: '+avx512vnni'), empty without
        the kernels."""
        if not self.available():
            return frozenset()
        if self._features is None:
            from .kernels.integer_dot import target_features

            self._features = target_features()
        return self._features

    def isa(self) -> str:
        """The instruction set the kernels' integer products run on (target.isa), or "" without
        the kernels."""
        return target.isa(self.features()) if self.available() else ""

    def half_floats(self) -> bool:
        """Whether the kernels can widen float16 (F16C; LLVM's software conversion is not
        linked into numba's code)."""
        return "+f16c" in self.features()

    def cached(self) -> list:
        """Every kernel with an on-disk cache, once built."""
        return list(self._cached)

    def specializations(self) -> int:
        """Machine-code versions built so far, over every kernel: numba builds one per argument
        type signature, so a step passing an unexpected type (a read-only or strided array)
        would compile again. The driver reports any growth as a compile."""
        # The dispatchers' own tables, counted: `signatures` hashes every argument type (35 us a step).
        return sum(len(k.overloads) for k in self._cached)

    # ---- threads ------------------------------------------------------------------------

    def set_threads(self, parallel: bool) -> None:
        """numba's threads for the next kernel: all of them, or the calling thread alone
        (also while OpenBLAS's threads may still spin)."""
        if parallel and time.monotonic() - self._last_blas < BLAS_SPIN_S:
            parallel = False
        threads = self.numba.config.NUMBA_NUM_THREADS if parallel else 1
        # numba's setting is the calling thread's own; setting it costs ~4 us, a step asks ~1,500 times.
        if getattr(self._threads_set, "n", None) != threads:
            self.numba.set_num_threads(threads)
            self._threads_set.n = threads

    def set_threads_for(self, work: int) -> None:
        """set_threads for a kernel of `work` multiply-adds."""
        self.set_threads(work >= PARALLEL_MIN_WORK)

    def threads(self) -> int:
        return self.numba.get_num_threads()

    def blas_ran(self) -> None:
        """A large product ran on OpenBLAS's threads, which now spin for a while."""
        self._last_blas = time.monotonic()

    @staticmethod
    def settle() -> None:
        """Waits out OpenBLAS's spinning threads."""
        time.sleep(BLAS_SPIN_S)


_shared: Runtime | None = None
_shared_lock = threading.Lock()


def shared() -> Runtime:
    """The process's runtime (numba's target and threading layer are the process's)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = Runtime()
        return _shared


def keep_cache_with_the_engines(numba) -> None:
    """numba's on-disk cache under the engine's cache (engine/cache_dir.py: numba/), unless
    NUMBA_CACHE_DIR names a folder: beside the sources (numba's default) it is lost with
    each fresh clone or reinstall, and a start that compiles every kernel takes a minute
    where one that loads them takes a second. Before any kernel's cache is made (the
    runtime's stamped caches pick their folder when applied)."""
    if not numba.config.CACHE_DIR:
        numba.config.CACHE_DIR = str(cache_root() / "numba")


def _smoke(k: KernelModules, progress=None, half: bool = True) -> int:
    """Runs the kernels every step may call on a known input (each built, or loaded from the
    cache, at its first call here); returns how many they are. `progress` hears which."""
    ran = (k.few_token.few_token_matmul, k.attention.paged_attention, k.glue.rms_scale, k.glue.silu_mul,
           k.glue.rope_store, k.glue.rms_run, k.glue.silu_rows, k.glue.rope_run)
    calls = iter(range(len(ran)))

    def next_kernel() -> None:
        if progress is not None:
            progress.report("compile", "compiling CPU kernels", next(calls), len(ran))

    next_kernel()
    w = np.ones((3, 2), np.float32)
    out = np.empty((3, 2), np.float32)
    k.few_token.few_token_matmul(w, np.ones((2, 2), np.float32), out)
    next_kernel()
    # The KV cache the CPU driver keeps by default, float16 bits (1.0 here): the float32
    # cache's variants compile where a driver first steps with one (the float32 path), not
    # at every start (a quarter of a fresh start's compiling went to them). Without F16C the
    # driver keeps float32 (numba's code cannot call LLVM's software conversion), so that.
    cache = np.full((2, 1, 1, 2, 2), np.float16(1).view(np.uint16), np.uint16) if half else \
        np.ones((2, 1, 1, 2, 2), np.float32)
    att = np.empty((1, 2), np.float32)
    k.attention.paged_attention(np.ones((1, 1, 2), np.float32), cache, np.zeros((1, 1), np.int64),
                                np.zeros(1, np.int64), np.ones(1, np.int64), att)
    next_kernel()
    norm = np.empty((2, 1), np.float32)
    k.glue.rms_scale(np.full((2, 1), 2, np.float32), np.float32(0), norm, 1)
    next_kernel()
    act = np.empty((1, 1), np.float32)
    k.glue.silu_mul(np.zeros((2, 1), np.float32), act)
    next_kernel()
    q = np.empty((1, 1, 2), np.float32)
    k.glue.rope_store(np.ones((6, 1), np.float32), np.array([[0, 1]], np.float32), np.zeros(1, np.int64),
                      np.zeros(1, np.int64), cache, q, 1)
    # The serial entry points, on the types the wrappers pass.
    next_kernel()
    serial_norm, serial_act = np.empty((2, 1), np.float32), np.empty((1, 1), np.float32)
    k.glue.rms_run(np.full((2, 1), 2, np.float32), np.float32(0), serial_norm, 0, 1)
    next_kernel()
    k.glue.silu_rows(np.zeros((2, 1), np.float32), serial_act, 0, 1)
    next_kernel()
    k.glue.rope_run(np.ones((6, 1), np.float32), np.array([[0, 1]], np.float32), np.zeros(1, np.int64),
                    np.zeros(1, np.int64), cache, q, 0, 1)
    if not (np.all(out == 2) and np.allclose(att, 1) and np.allclose(norm, 1) and act[0, 0] == 0
            and np.allclose(q, [[[-1, 1]]]) and np.allclose(serial_norm, 1) and serial_act[0, 0] == 0):
        raise RuntimeError("the compiled kernels gave wrong results on a known input")
    return len(ran)
