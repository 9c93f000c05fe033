"""Which path runs a product on block codes, chosen by timing the candidates on this machine
when the driver prepares (before /health says ok), not by assumption: the library that is fastest on one CPU
is not on another (on a 2-core Zen 4, OpenBLAS beat MKL at one token and MKL beat it at 32,
the reverse of what an Intel machine showed), and the integer path's lead over the float ones
shrinks as tokens grow.

Products of the same shape share a choice. For each shape and each token bucket up to the
step's most tokens, every candidate path runs on random activations and the fastest is kept;
a step of T tokens runs the choice of the smallest bucket >= T. Buckets of few tokens time a
pass over every matrix of the shape (what a real step reads: the weights from memory, not from
a warm cache); larger ones, whose products are bound by arithmetic, one matrix a few times.

Timed so that a process beside it (a build, a CI neighbour) does not hand a bucket to the
wrong path: a bucket's candidates take turns, pass by pass (a busy moment slows each of them
alike, not the one that happened to be timed then), each path's least pass counts, and a
bucket keeps the path of the bucket before it unless another beats it by KEEP_MARGIN (a table
of a few long runs, not one switching at every bucket on a few percent of noise), a margin
that grows with the share of the CPUs other processes took meanwhile (contention.py). Past
BUSY_LIMIT the timing stops: parallel kernels beside busy neighbours ran 2-5x slower by
moments whatever the passes, and the lead a challenger showed there was the neighbours'
doing; each product then keeps its first path, the registry's order of preference. What a
start measured is kept and read by the next starts (choice_cache.py).

The choice is plain data (`ShapeChoice.as_data`, `restore`): what was measured once can be
set again without timing anything.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .contention import Contention
from .registry import CODE_PATHS

BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
MEMORY_BOUND_TOKENS = 8  # up to here a timing pass reads every matrix of the shape
# Timed passes at up to MEMORY_BOUND_TOKENS, and above (one matrix a pass, a few ms): the least
# counts. One pass above had let a moment's noise hand a bucket to OpenBLAS in a server's
# start-up (int8 1-64, openblas 65-96, int8 97-192), whose threads then spin and keep the
# next steps' kernels to one thread.
REPEATS = 3
REPEATS_ABOVE = 3
PRUNE = 3.0  # a path this many times slower than the best after two passes is not timed again at this bucket
# A bucket keeps the previous bucket's path (the first bucket: the product's first path,
# registry.py's order) unless another is faster by this factor.
KEEP_MARGIN = 1.08
# Added to both margins (KEEP_MARGIN, OTHER_POOL_MARGIN) per share of the CPUs others took
# while a shape was timed: a fifth of them taken, a challenger must be 1.5x faster.
BUSY_LEAD = 2.0
# Beyond this share taken by others the timings tell nothing (beside 2 busy loops on 2 cores,
# others took 50%, and under a heavier load 77-80%, where a path won buckets by 2.6x that it
# lost by 3x quietly): the timing stops and each product keeps its first path. The choice is
# kept like any other, and a later start that finds the machine quieter measures again.
BUSY_LIMIT = 0.35
# Paths on OpenBLAS's own threads (Path.blas_threads): timed last in each shape (they spin
# afterwards, runtime.BLAS_SPIN_S), and chosen only when clearly faster than the best path on
# the pool every other kernel of a step runs on: timed alone a product cannot show what two
# pools on the same cores cost each other (on two cores, a step alternating between them ran
# several times slower).
SLOW_LAST = tuple(k.name for k in CODE_PATHS if k.blas_threads)
OTHER_POOL_MARGIN = 1.25


@dataclass(slots=True)
class ShapeChoice:
    """One shape's measurements: per bucket, each path's seconds per product, and the table."""

    shape: tuple[int, int]
    head: bool
    matrices: int
    seconds: dict[int, dict[str, float]] = field(default_factory=dict)
    table: list[tuple[int, str]] = field(default_factory=list)
    busy: float = 0.0  # the share of the CPUs other processes took while it was timed
    timed: bool = True  # False: set without timing, the machine too busy to tell (preferred())

    def chosen(self) -> str:
        """'int8 1-48, mkl 64-192' style: the path per token range."""
        parts, low = [], 1
        for most, path in self.table:
            parts.append(f"{path} {low}-{most}")
            low = most + 1
        return ", ".join(parts)

    def describe(self) -> str:
        o, i = self.shape
        return f"{o}x{i}{' head' if self.head else ''} x{self.matrices}: {self.chosen()}"

    def as_data(self) -> dict:
        """The choice as plain data (JSON's types): shape, head, matrices and table."""
        return {"shape": list(self.shape), "head": self.head, "matrices": self.matrices,
                "table": [[most, path] for most, path in self.table], "busy": round(self.busy, 3),
                "timed": self.timed}

    @classmethod
    def from_data(cls, data: dict) -> ShapeChoice:
        return cls(tuple(data["shape"]), bool(data["head"]), int(data["matrices"]),
                   table=[(int(most), str(path)) for most, path in data["table"]], busy=float(data.get("busy", 0.0)),
                   timed=bool(data.get("timed", True)))


def buckets_upto(tokens: int) -> list[int]:
    """The buckets a step of at most `tokens` tokens can fall in."""
    out = [b for b in BUCKETS if b < tokens]
    out.append(next((b for b in BUCKETS if b >= tokens), tokens))
    return out


def choose(products: list, max_tokens: int, head_tokens: int, run, settle, clock=time.perf_counter,
           progress=None, neighbours=None) -> list[ShapeChoice]:
    """Times every product path (`run(product, path, x)`, threads set as a step would set
    them) for steps of up to `max_tokens` tokens (the head: `head_tokens`, the logits a step
    asks for) and sets each product's table; `settle()` waits out the BLAS threads' spin
    after timing the paths in SLOW_LAST, which go after the others in each shape.
    `progress` (engine/progress.py) hears which shape is being timed; `neighbours()` starts
    a watch of the CPU others take (default: contention.py's): once they are seen to take more than
    BUSY_LIMIT of it, the timing stops and every product keeps its first path (`preferred`).
    Returns the measurements, one per shape."""
    groups = _groups(products)
    rng = np.random.default_rng(0)
    choices = []
    neighbours = neighbours or Contention
    overall = neighbours()
    for k, ((shape, head), members) in enumerate(groups.items()):
        if progress is not None:
            progress.report("measure", f"timing each product path on this machine, {shape[0]}x{shape[1]}", k,
                            len(groups))
        choice = ShapeChoice(shape, head, len(members))
        watch = neighbours()
        buckets = buckets_upto(head_tokens if head else max_tokens)
        inputs = {t: rng.standard_normal((shape[1], t), dtype=np.float32) for t in buckets}
        for pool in ([p for p in members[0].paths if p not in SLOW_LAST], [p for p in members[0].paths if p in SLOW_LAST]):
            if not pool:
                continue
            for tokens in buckets:
                choice.seconds.setdefault(tokens, {}).update(_time(members, pool, inputs[tokens], run, clock))
                if (busy := overall.share()) is not None and busy > BUSY_LIMIT:
                    return preferred(products, max_tokens, head_tokens, busy)
            if pool[0] in SLOW_LAST:
                settle()
        choice.busy = watch.share() or 0.0
        choices.append(choice)
    pools = _pool_per_bucket(choices)
    for choice in choices:
        choice.table = _table(choice.seconds, pools, groups[(choice.shape, choice.head)][0].paths[0],
                              KEEP_MARGIN + BUSY_LEAD * choice.busy)
    _apply(groups, choices)
    return choices


def preferred(products: list, max_tokens: int, head_tokens: int, busy: float = 0.0) -> list[ShapeChoice]:
    """Every product on its first path (registry.py's order of preference) at every token
    count, untimed (`timed` False): what a machine too busy to time gets."""
    groups = _groups(products)
    choices = []
    for (shape, head), members in groups.items():
        most = buckets_upto(head_tokens if head else max_tokens)[-1]
        choices.append(ShapeChoice(shape, head, len(members), table=[(most, members[0].paths[0])], busy=busy,
                                   timed=False))
    _apply(groups, choices)
    return choices


def restore(products: list, choices: list[ShapeChoice]) -> bool:
    """Sets each product's table from `choices` (as choose() made them, read back from their
    data) without timing anything. False, and nothing set, unless the choices are for the
    products' shapes, each with its number of matrices, naming only paths they have."""
    groups = _groups(products)
    by_shape = {(c.shape, c.head): c for c in choices}
    if set(by_shape) != set(groups):
        return False
    for key, members in groups.items():
        c = by_shape.get(key)
        if c is None or c.matrices != len(members) or not c.table or \
                any(path not in members[0].paths for _, path in c.table):
            return False
    _apply(groups, [by_shape[key] for key in groups])
    return True


def _groups(products: list) -> dict[tuple, list]:
    groups: dict[tuple, list] = {}
    for p in products:
        groups.setdefault((p.shape, p.head), []).append(p)
    return groups


def _apply(groups: dict[tuple, list], choices: list[ShapeChoice]) -> None:
    for choice in choices:
        for p in groups[(choice.shape, choice.head)]:
            p.table = list(choice.table)
            p.keep_only({path for _, path in choice.table})


def _time(members: list, paths: list[str], x: np.ndarray, run, clock) -> dict[str, float]:
    """Seconds one product takes on each of `paths`: the least over REPEATS passes over every
    matrix of the shape for few tokens, else over REPEATS_ABOVE passes of one matrix, once
    warmed; the paths take turns within each pass, the first of a pass a different one each
    time, and one PRUNE times slower than the best after two passes is timed no more."""
    tokens = x.shape[1]
    chosen = members if tokens <= MEMORY_BOUND_TOKENS else members[:1]
    # A path only some matrices hold (a float32 copy built for the first of the shape alone,
    # model_products.py) is not timed where a pass reads every matrix: timed over one, its
    # matrix would come from the cache. There it never won: 3-20x slower at one token, and
    # several times at 8 on 1B-sized matrices, in every table in perf-notes.
    paths = [path for path in paths if all(path in p.paths for p in chosen)]
    if not paths:
        return {}
    for path in paths:
        run(chosen[0], path, x)  # first use: pages touched, buffers made
    least = dict.fromkeys(paths, float("inf"))
    live = list(paths)
    for n in range(REPEATS if tokens <= MEMORY_BOUND_TOKENS else REPEATS_ABOVE):
        turn = n % len(live)
        for path in live[turn:] + live[:turn]:
            start = clock()
            for p in chosen:
                run(p, path, x)
            least[path] = min(least[path], (clock() - start) / len(chosen))
        if n:
            best = min(least.values())
            live = [p for p in live if least[p] <= PRUNE * best]
    return least


def _pool_per_bucket(choices: list[ShapeChoice]) -> dict[int, bool]:
    """Per bucket, whether the step's products run on OpenBLAS's threads (True) or on the
    shared pool: decided for the whole step, over the products of every shape at that token
    count, OpenBLAS only when its total beats the shared pool's by OTHER_POOL_MARGIN (and
    BUSY_LEAD for the busiest shape's neighbours)."""
    margin = OTHER_POOL_MARGIN + BUSY_LEAD * max((c.busy for c in choices), default=0.0)
    decided = {}
    for tokens in sorted({t for c in choices for t in c.seconds}):
        shared = other = 0.0
        for c in choices:
            timed = c.seconds.get(tokens)
            if not timed:
                continue
            same = [s for p, s in timed.items() if p not in SLOW_LAST]
            away = [s for p, s in timed.items() if p in SLOW_LAST]
            if not same or not away:  # one pool only: nothing to decide
                shared = other = 0.0
                break
            shared += min(same) * c.matrices
            other += min(away) * c.matrices
        decided[tokens] = bool(shared) and other * margin < shared
    return decided


def _table(seconds: dict[int, dict[str, float]], other_pool: dict[int, bool], first: str,
           margin: float = KEEP_MARGIN) -> list[tuple[int, str]]:
    """(most tokens, path) ascending, neighbouring buckets of one path merged: on the pool the
    bucket runs on, the path of the bucket before (at first, `first`) unless another is
    `margin` times faster, then the fastest."""
    table: list[tuple[int, str]] = []
    kept = first
    for tokens in sorted(seconds):
        timed = seconds[tokens]
        pool = {p: s for p, s in timed.items() if (p in SLOW_LAST) == other_pool.get(tokens, False)} or timed
        fastest = min(pool, key=pool.get)
        if kept in pool and pool[kept] <= margin * pool[fastest]:
            fastest = kept
        kept = fastest
        if table and table[-1][1] == fastest:
            table[-1] = (tokens, fastest)
        else:
            table.append((tokens, fastest))
    return table
