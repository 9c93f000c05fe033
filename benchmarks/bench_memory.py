"""What a prepared CPU engine holds resident, split into the weights' arrays, the KV cache and
the rest, beside the model file's size.

    .venv/bin/python benchmarks/bench_memory.py [--model PATH]   # default: SmolLM2
    .venv/bin/python -m benchmarks.llama_gguf --size 1b --out /tmp/llama-1b-q4_1.gguf
    .venv/bin/python benchmarks/bench_memory.py --model /tmp/llama-1b-q4_1.gguf

The engine is made as poot-serve makes it (the product choice kept on this machine, or
measured), then: the process's resident set from /proc (anonymous and file-backed), the KV
pool's bytes (written through at start, so all resident), the weights' bytes (every array
the products and the decoder stack hold, counted once however many views share it, and the
resident pages of the loader's mapped cache, from /proc/self/smaps), and the rest (Python,
the shared libraries, numba's code, NumPy's and MKL's buffers). The peak is the high-water mark of preparing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_startup import cpu  # noqa: E402

GB = 1e9


def status() -> dict[str, int]:
    fields = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                fields[key] = int(value.split()[0]) * 1024
    return fields


def held_arrays(root, depth: int = 8) -> list[np.ndarray]:
    """Every ndarray reachable from `root` through attributes, slots, tuples, lists and dicts,
    `depth` levels down; the owner of each (its base chain's last array) once."""
    found: dict[int, np.ndarray] = {}
    seen: set[int] = set()

    def owner(a: np.ndarray) -> np.ndarray:
        while isinstance(a.base, np.ndarray):
            a = a.base
        return a

    def visit(obj, level: int) -> None:
        if id(obj) in seen or level > depth:
            return
        seen.add(id(obj))
        if isinstance(obj, np.ndarray):
            top = owner(obj)
            found[id(top)] = top
            return
        if isinstance(obj, (str, bytes, int, float, bool, type(None))):
            return
        if isinstance(obj, dict):
            items = list(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            items = list(obj)
        else:
            items = list(getattr(obj, "__dict__", {}).values())
            for cls in type(obj).__mro__:
                items += [getattr(obj, s, None) for s in getattr(cls, "__slots__", ())]
        for item in items:
            visit(item, level + 1)

    visit(root, 0)
    return list(found.values())


def file_mappings(model) -> dict[int, object]:
    """The loader's mappings (its cache's files) the model's weights and codes lie in, by id:
    the kernels' own arrays on 2 MiB pages lie in anonymous mappings and count as theirs."""
    from poot.engine.drivers.cpu.platform.mapped import mapping_of

    arrays = list(getattr(model.weights, "floats", model.weights).values())  # no coded weight made
    arrays += [a for c in (model.block_codes or {}).values() for a in (c.codes, c.d, c.m)]
    return {id(m): m for a in arrays if (m := mapping_of(a)) is not None}


def resident_in(mappings) -> int:
    """The resident bytes of these mmaps, from /proc/self/smaps."""
    starts = {np.frombuffer(m, np.uint8, 1).ctypes.data for m in mappings if len(m)}
    total, current = 0, None
    with open("/proc/self/smaps", encoding="ascii", errors="replace") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                current = int(head.split("-")[0], 16)
            elif head == "Rss:" and current in starts:
                total += int(line.split()[1]) * 1024
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF file (default: SmolLM2, the default model)")
    a = ap.parse_args(argv)
    from poot.engine.engine import Engine
    from poot.engine.models import load_model
    from poot.loadtests.peers import default_gguf

    path = Path(a.model) if a.model else default_gguf()
    started = time.monotonic()
    model = load_model(str(path))
    loaded = time.monotonic() - started
    engine = Engine.create(model, backend="numpy")
    ready = time.monotonic() - started
    driver = engine.driver
    mem = status()
    kv = driver.kv_pool.nbytes if driver.kv_pool is not None else 0
    arrays = held_arrays([driver.products, driver.stack])
    from poot.engine.drivers.cpu.platform.mapped import mapping_of

    files = file_mappings(model)
    pool = mapping_of(driver.kv_pool) if driver.kv_pool is not None else None  # the stack holds it too
    own = sum(x.nbytes for x in arrays if id(mapping_of(x)) not in files and (pool is None or mapping_of(x) is not pool))
    touched = resident_in(files.values())  # the embedding's rows a step looked up, the norms
    weights = own + touched
    rest = mem["VmRSS"] - weights - kv
    size = path.stat().st_size
    kv_tokens = engine.plan.num_blocks * engine.plan.block_size
    name, flags, cores = cpu()
    print(f"cpu: {name}, {cores} cores ({' '.join(flags)})")
    print(f"model: {path.name} ({size / GB:.3f} GB), {model.config.weight_count() / 1e9:.2f}B weights; "
          f"loaded in {loaded:.1f} s, engine ready after {ready:.1f} s")
    print(f"plan: {engine.plan.rows} rows, KV for {kv_tokens} tokens; products: {', '.join(engine.plan.products)}")
    print(f"resident {mem['VmRSS'] / GB:.2f} GB (anonymous {mem['RssAnon'] / GB:.2f}, file-backed "
          f"{mem['RssFile'] / GB:.2f}); peak while preparing {mem['VmHWM'] / GB:.2f} GB")
    print(f"  weights {weights / GB:.2f} GB = {weights / size:.2f}x the file "
          f"(the products' own arrays {own / GB:.2f}, pages of the mapped cache {touched / GB:.2f})")
    print(f"  KV cache {kv / GB:.2f} GB ({kv / max(kv_tokens, 1) / 1024:.1f} KiB a token)")
    print(f"  the rest {rest / GB:.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
