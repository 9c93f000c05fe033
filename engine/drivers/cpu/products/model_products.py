"""Every weight product of one prepared model, by weight name (`ModelProducts`): the matrices
the family found block codes for on their paths (the choice measured on this machine once and
kept, choice.py and choice_cache.py), the rest in float32, the large ones packed once for MKL
where it loads. Built once per prepare; a step asks it for a product by the name its op gives."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np

from ..platform.host import usable_cores
from ..runtime import Runtime
from . import choice
from .choice_cache import ChoiceCache, Stored, choice_key, now_utc
from .contention import Contention
from .integer import INTEGER_PATHS
from .product import Product, coded_product, float_product
from .registry import CODE_PATHS

log = logging.getLogger("poot.engine")


class ModelProducts:
    def __init__(self, weights: dict[str, np.ndarray], names: list[str], runtime: Runtime, head: str | None = None,
                 codes: dict | None = None, use_mkl: bool = True, int8: bool = True, keep: dict | None = None,
                 progress=None, copies_for_one: bool = False):
        """`names`: the weights the program's products read; `head`: the output head's, whose
        products return token-major logits; `codes`: {name: (BlockCodes, colscale or None)} for
        the matrices whose products run on block codes, on the paths this machine has: integer
        dot products where the CPU has them (and `int8`), MKL where it loads (and `use_mkl`).
        `keep`: {(shape, head): path names} builds only those paths of the matrices on codes
        of that shape (what a kept choice names: the others would cost their layouts and
        copies for nothing); `progress` (engine/progress.py) hears how far building is.
        `copies_for_one` (with no `keep`, for measuring): of each shape's matrices only the
        first gets the paths that hold a float32 copy (Path.float_copy); the others get them in
        measure() where they win a bucket. A Llama 3.2 1B shape's copies for every path took
        12.8 GB to time."""
        codes = codes or {}
        allowed = allowed_paths(use_mkl, int8)
        self.runtime = runtime
        wanted = {*names, *([head] if head is not None else [])}
        coded = [name for name in codes if name in wanted]
        self._products: dict[str, Product] = {}
        self._sources: dict[str, tuple] = {}  # the codes of matrices built without their copies
        copied: set[tuple] = set()  # the shapes whose first matrix has its copies
        builds = []  # (name, the paths it gets)
        for name in coded:
            c, scale = codes[name]
            group = _group(c, name, head)
            paths = allowed if keep is None else tuple(p for p in allowed if p in keep.get(group, allowed))
            if copies_for_one and keep is None:
                if group in copied:
                    paths = tuple(p for p in paths if not _PATHS[p].float_copy)
                    self._sources[name] = (c, scale)
                copied.add(group)
            builds.append((name, paths))
        if codes:
            self._build_coded(builds, codes, head, allowed, progress)
        for name in sorted(wanted - set(codes)):
            self._products[name] = float_product(weights[name], runtime, head=name == head, use_mkl=use_mkl)
        self.choices: list[choice.ShapeChoice] = []  # once measure() or restore() has run
        self.measure_seconds = 0.0
        self.measured_at = ""  # when the choice was measured (UTC), here or by the start that kept it
        self.measured_now = False  # measured by this prepare, not read

    def _build_coded(self, builds: list[tuple[str, tuple]], codes: dict, head: str | None,
                     allowed: tuple[str, ...], progress) -> None:
        """The products on codes, each matrix laid out for its paths, while the block kernels
        load and are checked. Laying out is NumPy's copies, which let go of the GIL, and
        loading a kernel from numba's cache is mostly LLVM's: on a second core they run side
        by side (a Llama 3.2 1B shape's warm start spent 1.9 s loading and 3.5 s laying out,
        one after the other)."""
        if progress is not None:
            progress.report("compile", "compiling the block-code kernels")
        runtime = self.runtime

        def build(item: tuple[str, tuple]) -> Product:
            name, paths = item
            c, scale = codes[name]
            return coded_product(c, scale, runtime, paths, head=name == head)

        # Packing float32 copies for MKL stays one at a time: its own threads serve each call.
        copies = any(_PATHS[p].float_copy for _, paths in builds for p in paths)
        with ThreadPoolExecutor(1 if copies else layout_workers(), thread_name_prefix="poot-layout") as pool:
            checked = pool.submit(check_code_paths, runtime, allowed)
            for done, product in enumerate(pool.map(build, builds), start=1):
                if progress is not None:
                    progress.report("compile", "laying out the weights for their products", done, len(builds))
                self._products[builds[done - 1][0]] = product
            checked.result()  # a wrong result on the known input raises here

    @classmethod
    def chosen(cls, weights: dict[str, np.ndarray], names: list[str], runtime: Runtime, rows: int, token_budget: int,
               max_step_tokens: int, head: str | None = None, codes: dict | None = None, use_mkl: bool = True,
               int8: bool = True, cache: ChoiceCache | None = None, remeasure: bool = False,
               progress=None, quiet=None) -> ModelProducts:
        """The products with their choice made for a plan of `rows` rows, `token_budget` and
        `max_step_tokens`: read from `cache` where it keeps one measured under the same
        conditions (choice_cache.py; only the paths it names are built), else measured and
        kept there; `remeasure` measures whatever is kept. `quiet()`, before anything is
        timed, waits for what the caller runs beside preparing."""
        codes = codes or {}
        wanted = {*names, *([head] if head is not None else [])}
        shapes = code_shapes({n: c for n, c in codes.items() if n in wanted}, head, runtime, allowed_paths(use_mkl, int8))
        key = choice_key(list(shapes.values()), rows, token_budget, max_step_tokens, runtime) if shapes else None
        stored = cache.read(key) if cache is not None and key is not None and not remeasure else None
        if stored is not None and not all(c.get("timed", True) for c in stored.choices) and _quiet_now():
            log.info("the kept product choice was made while the machine was too busy to time; "
                     "it is quieter now: measuring again")
            stored = None
        if stored is not None:
            try:
                keep = {(tuple(c["shape"]), bool(c["head"])): {path for _, path in c["table"]} for c in stored.choices}
                products = cls(weights, names, runtime, head, codes, use_mkl, int8, keep=keep, progress=progress)
                if products.restore(stored.choices):
                    products.measure_seconds, products.measured_at = stored.seconds, stored.measured_at
                    return products
            except (KeyError, TypeError, ValueError):
                pass
            log.warning("the kept product choice does not fit this model's products: measuring again")
        products = cls(weights, names, runtime, head, codes, use_mkl, int8, progress=progress, copies_for_one=True)
        if products.coded:
            if quiet is not None:
                quiet()
            products.measure(max_step_tokens, rows, progress)
            if not products.timed:
                log.warning("other processes took %.0f%% of the CPUs while the products were being timed: each "
                            "keeps its first path (%s) until a start on a quieter machine measures again",
                            100 * max(c.busy for c in products.choices),
                            ", ".join(sorted({p.path_for(1) for p in products.on_codes()})))
            if cache is not None and key is not None:
                cache.write(key, Stored(products.choices_data(), products.measured_at, products.measure_seconds))
        return products

    def __getitem__(self, name: str) -> Product:
        return self._products[name]

    def get(self, name: str) -> Product | None:
        return self._products.get(name)

    def on_codes(self) -> list[Product]:
        """The products on block codes."""
        return [p for p in self._products.values() if p.quantized]

    @property
    def coded(self) -> int:
        """How many weight matrices run their products on block codes."""
        return len(self.on_codes())

    @property
    def packed(self) -> int:
        """How many float32 weight matrices run on MKL's packed products."""
        return sum(1 for p in self._products.values() if not p.quantized and "mkl" in p.paths)

    def measure(self, max_tokens: int, head_tokens: int, progress=None) -> list[choice.ShapeChoice]:
        """Times each product on block codes on each of its paths for steps of up to
        `max_tokens` tokens (the head: `head_tokens`) and keeps the fastest per shape and
        token count (choice.py); returns the measurements."""
        start = time.perf_counter()
        self.choices = choice.choose(self.on_codes(), max_tokens, head_tokens,
                                     lambda product, path, x: product.run(x, path=path), self.runtime.settle,
                                     progress=progress)
        self._complete()
        self.measure_seconds = time.perf_counter() - start
        self.measured_at, self.measured_now = now_utc(), True
        return self.choices

    def _complete(self) -> None:
        """Builds the paths its shape's table names on each matrix built without them
        (`copies_for_one`): a float32 copy only where it won a bucket."""
        for name, (c, scale) in self._sources.items():
            product = self._products[name]
            wanted = tuple(dict.fromkeys(path for _, path in product.table))
            if all(path in product.paths for path in wanted):
                continue
            whole = coded_product(c, scale, self.runtime, (*product.paths, *wanted), head=product.head)
            whole.table = product.table
            self._products[name] = whole
        self._sources = {}

    @property
    def timed(self) -> bool:
        """False where the choice was set without timing, the machine too busy (choice.preferred)."""
        return all(c.timed for c in self.choices)

    def origin(self) -> str:
        """How the choice was made: "measured" by this prepare, "preferred" by it without
        timing (the machine too busy), or "cached" (read from what an earlier start kept)."""
        if not self.measured_now:
            return "cached"
        return "measured" if self.timed else "preferred"

    def choices_data(self) -> list[dict]:
        """The choice made, as plain data, for restore()."""
        return [c.as_data() for c in self.choices]

    def restore(self, data: list[dict]) -> bool:
        """Sets the choice from choices_data() without timing anything; False, and nothing set,
        where it does not fit these products (choice.restore)."""
        choices = [choice.ShapeChoice.from_data(d) for d in data]
        if not choice.restore(self.on_codes(), choices):
            return False
        self.choices = choices
        return True


def layout_workers() -> int:
    """Threads that lay out weights while a driver prepares: one a core, at most 4 (each holds
    one matrix's temporaries)."""
    return max(1, min(4, usable_cores()))


QUIET_PROBE_S = 0.25  # how long a start that found a choice made too busy to time watches the machine


def _quiet_now() -> bool:
    """Whether others take at most choice.BUSY_LIMIT of the CPUs over a short watch (False
    where the machine does not say)."""
    watch = Contention()
    time.sleep(QUIET_PROBE_S)
    share = watch.share()
    return share is not None and share <= choice.BUSY_LIMIT


_PATHS = {k.name: k for k in CODE_PATHS}


def allowed_paths(use_mkl: bool, int8: bool) -> tuple[str, ...]:
    """The paths on codes a driver lets its products take (before what the machine has)."""
    return tuple(k.name for k in CODE_PATHS if (k.name != "mkl" or use_mkl) and (int8 or k not in INTEGER_PATHS))


def _group(codes, name: str, head: str | None) -> tuple:
    return tuple(codes.codes.shape), name == head


def code_shapes(codes: dict, head: str | None, runtime: Runtime, allowed: tuple[str, ...]) -> dict[tuple, dict]:
    """Per (shape, head) of the matrices on codes, what their choice depends on: how many,
    their codes' types, and the paths this machine offers them (before any is built)."""
    shapes: dict[tuple, dict] = {}
    for name, (c, _) in codes.items():
        group = _group(c, name, head)
        entry = shapes.setdefault(group, {
            "shape": list(group[0]), "head": group[1], "matrices": 0, "codes": [],
            "paths": [k.name for k in CODE_PATHS if k.name in allowed and k.available(runtime) and k.fits(group[0])]})
        entry["matrices"] += 1
        if str(c.codes.dtype) not in entry["codes"]:
            entry["codes"] = sorted([*entry["codes"], str(c.codes.dtype)])
    return shapes


def check_code_paths(runtime: Runtime, names: tuple[str, ...]) -> None:
    """Runs every path on block codes that compiles a kernel of its own, among `names` and
    those this machine has, on a known input; raises RuntimeError on a wrong result."""
    codes = SimpleNamespace(codes=np.full((5, 64), 2, np.uint8), d=np.full((5, 2), 0.5, np.float32),
                            m=np.full((5, 2), 1.0, np.float32), values=lambda: np.full((5, 64), 2, np.float32))
    for kind in CODE_PATHS:
        if kind.name in names and kind.numba_kernel and kind.available(runtime):
            out = np.full((5, 3), 1.0, np.float32)
            coded_product(codes, None, runtime, (kind.name,)).run(np.ones((64, 3), np.float32), out=out)
            if not np.allclose(out, 129, rtol=1e-5):
                raise RuntimeError(f"the {kind.name} block kernels gave wrong results on a known input")
