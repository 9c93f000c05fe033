"""Every path a product on block codes may take, timed at the token counts the CPU driver's
choice times (products/choice.py's buckets), on SmolLM2's matrices: what the choice saw on
this machine, path by path, and what it picked.

    .venv/bin/python benchmarks/bench_product_paths.py [--model default] [--json PATH]
    MKL_CBWR=COMPATIBLE .venv/bin/python benchmarks/bench_product_paths.py   # MKL's generic code

The driver prepares as `poot-serve --retune` does (its choice measured afresh, kept in a
temporary folder, not the user's cache), and the choice's own timings are printed: per shape,
milliseconds per product for each path and token count, `*` on the path its table runs there.
The paths that hold a float32 copy (MKL, OpenBLAS) are timed from 12 tokens up, on
the first matrix of each shape (only it has the copy while the choice is made); their
few-token cells stay empty. A path the choice stopped timing at a token count (three times slower than the best after two
passes) shows the figure it had then, in brackets. The header names the CPU, its vector flags,
the code MKL runs (its branch; "auto" on a CPU that is not Intel's) and OpenBLAS's kernels.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_startup import cpu  # noqa: E402


def measure(model_spec: str | None) -> dict:
    from poot.engine.drivers.cpu import CpuDriver
    from poot.engine.drivers.cpu.platform import host, mkl
    from poot.engine.drivers.cpu.products.choice import PRUNE
    from poot.engine.drivers.cpu.products.choice_cache import ChoiceCache
    from poot.engine.models import load_model
    from poot.engine.plan import fit_plan

    model = load_model(model_spec)
    with tempfile.TemporaryDirectory() as folder:
        driver = CpuDriver(choices=ChoiceCache(folder))
        driver.retune = True
        plan = fit_plan(driver.device(), model.config, driver.weight_bytes(model), model.name)
        driver.prepare(plan, model)
    name, flags, cores = cpu()
    shapes = []
    for c in driver.products.choices:
        rows = []
        for tokens in sorted(c.seconds):
            timed = c.seconds[tokens]
            best = min(timed.values())
            rows.append({"tokens": tokens, "chosen": next(p for most, p in c.table if tokens <= most),
                         "ms": {p: s * 1e3 for p, s in timed.items()},
                         "pruned": [p for p, s in timed.items() if s > PRUNE * best]})
        shapes.append({"shape": c.describe().split(":")[0], "busy": c.busy, "timed": c.timed, "rows": rows})
    return {"cpu": name, "flags": flags, "cores": cores, "isa": plan.isa,
            "mkl": mkl.dispatched() if mkl.available() else mkl.unavailable_reason(),
            "openblas": host.blas_core() or "unnamed", "shapes": shapes}


def render(result: dict) -> str:
    lines = [f"CPU: {result['cpu']} ({result['cores']} cores; {', '.join(result['flags'])}); integer path: "
             f"{result['isa']}; MKL: {result['mkl']}; OpenBLAS: {result['openblas']}"]
    for s in result["shapes"]:
        paths = sorted({p for r in s["rows"] for p in r["ms"]})
        note = "" if s["timed"] else " (not timed: the machine was too busy)"
        lines += ["", f"{s['shape']}, ms per product; others took {s['busy']:.0%} of the CPUs{note}",
                  "| tokens | " + " | ".join(paths) + " |", "|---:|" + "---:|" * len(paths)]
        for r in s["rows"]:
            cells = []
            for p in paths:
                ms = r["ms"].get(p)
                text = "" if ms is None else f"{ms:.3f}"
                if ms is not None and p in r["pruned"]:
                    text = f"[{text}]"
                cells.append(text + ("*" if p == r["chosen"] else ""))
            lines.append(f"| {r['tokens']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model file, 'synthetic', or the default model (SmolLM2)")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    result = measure(None if args.model in (None, "default") else args.model)
    print(render(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
