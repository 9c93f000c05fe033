"""What one decode iteration of the engine runs, as Python sees it: its frames, per file.

    .venv/bin/python benchmarks/trace_decode_step.py [--rows N] [--model GGUF]

Serves N greedy requests on the CPU driver until they all decode, then profiles one whole
iteration of the loop (its five phases, the driver's step and the commit) and prints how
many Python frames it entered, in how many of poot's files, and the count per file. Native
work (NumPy, numba kernels) is one frame however long it runs: this counts the Python that
stands between the loop and the device, not the time.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import poot.engine
from poot.engine import Engine, SamplingParams
from poot.engine.models import load_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1, help="requests decoding together")
    p.add_argument("--model", default=None, help="a GGUF file instead of SmolLM2")
    args = p.parse_args()
    engine = Engine.create(load_model(args.model), backend="numpy")
    for i in range(args.rows):
        engine.submit(f"Tell me about the sea, {i}.", SamplingParams(max_tokens=64, temperature=0, ignore_eos=True),
                      lambda event: None)
    while any(q.prefilling for q in engine.scheduler.running) or engine.scheduler.waiting or not engine.scheduler.running:
        engine.iteration()
    engine.iteration()  # one decoding iteration before the traced one, so nothing is first-use
    frames: collections.Counter[str] = collections.Counter()

    def count(frame, event, _arg):
        if event == "call":
            frames[frame.f_code.co_filename] += 1

    sys.setprofile(count)
    engine.iteration()
    sys.setprofile(None)
    root = os.path.dirname(os.path.realpath(poot.engine.__path__[0]))  # the checkout that holds engine/
    ours = {f: n for f, n in frames.items() if not f.startswith("<") and "site-packages" not in f
            and os.path.realpath(f).startswith(root + os.sep) and "benchmarks" not in f}
    generated = sum(n for f, n in frames.items() if f.startswith("<"))  # dataclasses' __init__ and the like
    print(f"one decode iteration, {args.rows} row(s), CPU driver: {sum(frames.values())} Python frames, "
          f"{sum(ours.values())} in {len(ours)} of poot's files, {generated} in generated code")
    for f, n in sorted(ours.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"{n:5d}  {os.path.relpath(os.path.realpath(f), root)}")


if __name__ == "__main__":
    main()
