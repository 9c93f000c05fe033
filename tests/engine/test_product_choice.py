"""Choosing each product's path by measurement (engine/drivers/cpu/products/choice.py), on fake
products whose paths cost what the test says, timed on a fake clock."""

from __future__ import annotations

import pytest

from poot.engine.drivers.cpu.products import choice


class FakeProduct:
    def __init__(self, shape, paths, head=False):
        self.shape, self.paths, self.head = shape, tuple(paths), head
        self.table = []
        self.kept = None

    def keep_only(self, paths):
        self.kept = set(paths)


class Clock:
    """Advances only when a fake product runs: by cost(shape, path, tokens) seconds."""

    def __init__(self, cost):
        self.now, self.cost, self.calls = 0.0, cost, []

    def __call__(self):
        return self.now

    def run(self, product, path, x):
        self.calls.append((product.shape, path, x.shape[1]))
        self.now += self.cost(product.shape, path, x.shape[1])


class Neighbours:
    """A watch of the CPU others take that says they took `share` of it."""

    def __init__(self, share: float | None = 0.0):
        self.value = share

    def __call__(self):
        return self

    def share(self):
        return self.value


def _choose(products, cost, max_tokens=64, head_tokens=8, busy: float | None = 0.0):
    clock = Clock(cost)
    settled = []
    made = choice.choose(products, max_tokens, head_tokens, clock.run, lambda: settled.append(clock.now), clock,
                         neighbours=Neighbours(busy))
    return made, clock, settled


def test_the_fastest_path_wins_each_bucket_and_neighbours_merge():
    # int8 costs 1 + t/4, mkl a flat 6: int8 is faster up to 20 tokens.
    products = [FakeProduct((64, 32), ("int8", "mkl")) for _ in range(3)]
    made, _, _ = _choose(products, lambda s, p, t: 1 + t / 4 if p == "int8" else 6)
    assert [c.table for c in made] == [[(16, "int8"), (64, "mkl")]]
    assert all(p.table == [(16, "int8"), (64, "mkl")] and p.kept == {"int8", "mkl"} for p in products)
    assert made[0].describe() == "64x32 x3: int8 1-16, mkl 17-64"


def test_a_path_that_wins_nowhere_is_dropped():
    products = [FakeProduct((8, 32), ("int8", "blocks", "mkl"))]
    _choose(products, lambda s, p, t: {"int8": 1, "blocks": 2, "mkl": 3}[p])
    assert products[0].kept == {"int8"}


def test_few_token_buckets_time_every_matrix_and_larger_ones_one():
    products = [FakeProduct((16, 32), ("int8",)) for _ in range(4)]
    _, clock, _ = _choose(products, lambda s, p, t: 1.0, max_tokens=32)
    per_bucket = {}
    for _, _, tokens in clock.calls:
        per_bucket[tokens] = per_bucket.get(tokens, 0) + 1
    # One warm-up call, then REPEATS passes over all four matrices; above: warm-up and
    # REPEATS_ABOVE calls on one matrix (the least counts: one pass let noise pick a path).
    assert per_bucket[1] == per_bucket[8] == 1 + choice.REPEATS * 4
    assert per_bucket[12] == per_bucket[32] == 1 + choice.REPEATS_ABOVE
    assert sorted(per_bucket) == [b for b in choice.BUCKETS if b <= 32]


def test_the_head_is_timed_up_to_the_logits_a_step_asks_for():
    products = [FakeProduct((100, 32), ("int8",), head=True), FakeProduct((16, 32), ("int8",))]
    made, clock, _ = _choose(products, lambda s, p, t: 1.0, max_tokens=100, head_tokens=5)
    head = next(c for c in made if c.head)
    assert max(head.seconds) == 6  # the bucket holding 5
    assert max(next(c for c in made if not c.head).seconds) == 128


def test_openblas_needs_a_clear_lead_over_the_whole_step_and_is_timed_last():
    shapes = [(64, 32), (32, 64)]
    products = [FakeProduct(s, ("int8", "openblas")) for s in shapes]

    def cost(shape, path, tokens):
        if path == "int8":
            return 10.0
        # A small lead on one shape, a large one on the other, from 8 tokens on.
        lead = (0.5 if shape == shapes[0] else 0.95) if tokens >= 8 else 2.0
        return 10.0 * lead

    made, clock, settled = _choose(products, cost, max_tokens=8)
    # 8 tokens: total 10 * (0.5 + 0.95) = 14.5 against 20 on int8: a lead of 1.38 > the margin.
    assert all(c.table == [(6, "int8"), (8, "openblas")] for c in made)
    assert len(settled) == 2  # the spin waited out once per shape, after its openblas timings
    paths = [path for shape, path, _ in clock.calls if shape == shapes[0]]
    assert paths == sorted(paths, key=lambda p: p == "openblas")


def test_a_lead_within_the_margin_keeps_the_shared_pool():
    products = [FakeProduct((64, 32), ("int8", "mkl", "openblas"))]
    costs = {"int8": 10.0, "mkl": 12.0, "openblas": 10.0 / (choice.OTHER_POOL_MARGIN * 0.99)}
    made, _, _ = _choose(products, lambda s, p, t: costs[p], max_tokens=2)
    assert made[0].table == [(2, "int8")]


@pytest.mark.parametrize("tokens, want", [(1, [1]), (5, [1, 2, 3, 4, 6]), (176, list(choice.BUCKETS[:15]))])
def test_buckets_reach_the_first_one_holding_the_most_tokens(tokens, want):
    assert choice.buckets_upto(tokens) == want


def test_a_moments_noise_does_not_hand_a_bucket_to_another_pool():
    """int8 twice as fast as OpenBLAS everywhere, but its first timed call at 96 tokens caught
    a pause (10x): the least of the passes still picks int8 there (OpenBLAS would spin)."""
    hits = {"int8": 0}

    def cost(shape, path, tokens):
        if path == "int8":
            if tokens == 96:
                hits["int8"] += 1
                return 10.0 if hits["int8"] == 2 else 1.0  # the first timed call, after warm-up
            return 1.0
        return 2.0

    products = [FakeProduct((64, 32), ("int8", "openblas"))]
    made, _, _ = _choose(products, cost, max_tokens=128)
    assert made[0].table == [(128, "int8")] and products[0].kept == {"int8"}


def test_a_choice_comes_back_from_its_plain_data():
    """The measured choice as JSON and back sets the same tables on the same shapes without
    timing anything; it is refused, and nothing set, where the products differ."""
    import json

    def model():
        return [FakeProduct((64, 32), ("int8", "mkl")) for _ in range(3)] + [FakeProduct((100, 32), ("int8",), head=True)]

    measured = model()
    made, _, _ = _choose(measured, lambda s, p, t: 1 + t / 4 if p == "int8" else 6)
    choices = [choice.ShapeChoice.from_data(d) for d in json.loads(json.dumps([c.as_data() for c in made]))]
    again = model()
    assert choice.restore(again, choices)
    assert [(p.table, p.kept) for p in again] == [(p.table, p.kept) for p in measured]
    assert [c.describe() for c in choices] == [c.describe() for c in made]
    fewer = model()[1:]  # two matrices of the shape measured three times
    lacking = [FakeProduct((64, 32), ("int8",)) for _ in range(3)] + model()[3:]  # no mkl path
    for products in (fewer, lacking, model()[:3]):
        assert not choice.restore(products, choices)
        assert all(p.table == [] and p.kept is None for p in products)


def test_a_busy_spell_slows_every_candidate_alike():
    """A neighbour takes the machine for the first 12 s of the measuring (every run three times
    slower then). int8 is the faster path (1.0 against 1.15 a run) but runs first: timed one
    path after the other, all its runs would fall in the spell and the bucket go to mkl. The
    candidates take turns, pass by pass, and the least pass counts: int8 keeps it."""
    products = [FakeProduct((64, 32), ("int8", "mkl"))]
    clock = Clock(None)
    clock.cost = lambda s, p, t: (1.0 if p == "int8" else 1.15) * (3.0 if clock.now < 12.0 else 1.0)
    made = choice.choose(products, 1, 1, clock.run, lambda: None, clock, neighbours=Neighbours())
    assert made[0].table == [(1, "int8")], made[0].seconds


def test_the_candidates_take_turns_and_each_pass_starts_with_another():
    products = [FakeProduct((64, 32), ("int8", "blocks", "mkl"))]
    _, clock, _ = _choose(products, lambda s, p, t: 1.0, max_tokens=1)
    runs = [path for _, path, _ in clock.calls]
    assert runs[:3] == ["int8", "blocks", "mkl"]  # each warmed once
    passes = [runs[3 + 3 * n: 6 + 3 * n] for n in range(choice.REPEATS)]
    assert passes[:3] == [["int8", "blocks", "mkl"], ["blocks", "mkl", "int8"], ["mkl", "int8", "blocks"]]


@pytest.mark.parametrize("lead, switches", [(0.95, False), (0.8, True)])
def test_a_bucket_keeps_the_path_before_it_unless_another_is_clearly_faster(lead, switches):
    """From 16 tokens mkl is faster than int8 by 5% (noise, on a busy machine) or by 20%: only
    the clear lead moves those buckets off the path the buckets below chose."""
    products = [FakeProduct((64, 32), ("int8", "mkl"))]
    made, _, _ = _choose(products, lambda s, p, t: 1.0 if p == "int8" else (lead if t >= 16 else 1.5), max_tokens=64)
    assert made[0].table == ([(12, "int8"), (64, "mkl")] if switches else [(64, "int8")])


def test_the_first_bucket_keeps_the_products_first_path_unless_another_is_clearly_faster():
    products = [FakeProduct((64, 32), ("int8", "blocks"))]
    made, _, _ = _choose(products, lambda s, p, t: 1.0 if p == "int8" else 0.96, max_tokens=4)
    assert made[0].table == [(4, "int8")]


@pytest.mark.parametrize("busy, switches", [(0.0, True), (None, True), (0.5, False)])
def test_the_busier_the_machine_was_the_clearer_a_lead_must_be(busy, switches):
    """mkl 1.5x faster from 16 tokens: taken on a quiet machine (or one that does not say),
    not where others took half of the CPUs while it was timed (the lead may be theirs)."""
    products = [FakeProduct((64, 32), ("int8", "mkl", "openblas"))]
    cost = {"int8": 1.5, "mkl": 1.0, "openblas": 1.0}
    made, _, _ = _choose(products, lambda s, p, t: cost[p] if t >= 16 else (1.0 if p == "int8" else 2.0),
                         max_tokens=64, busy=busy)
    assert made[0].table == ([(12, "int8"), (64, "mkl")] if switches else [(64, "int8")])
    assert made[0].busy == (busy or 0.0) and made[0].as_data()["busy"] == (busy or 0.0)


def test_the_watch_of_others_says_nothing_for_a_moment_and_a_share_after_one():
    from poot.engine.drivers.cpu.products.contention import Contention

    watch = Contention()
    assert watch.share() is None  # a moment: the counters tick every 10 ms
    import time

    deadline = time.monotonic() + 0.25
    while time.monotonic() < deadline:
        pass
    share = watch.share()
    assert share is None or 0.0 <= share <= 1.0


def test_a_path_only_the_first_matrix_holds_is_timed_there_and_only_above_the_memory_bound():
    """A float32 copy built for the first matrix of a shape alone (model_products.py): timed on
    that matrix where a pass times one, never where a pass reads every matrix, and it can
    still win the buckets it is timed at."""
    first = FakeProduct((64, 32), ("int8", "mkl"))
    products = [first, *(FakeProduct((64, 32), ("int8",)) for _ in range(3))]
    clock = Clock(lambda s, p, t: 1 + t / 4 if p == "int8" else 6)

    def run(product, path, x):
        assert path in product.paths, f"{path} ran on a matrix without it"
        clock.run(product, path, x)

    made = choice.choose(products, 64, 8, run, lambda: None, clock, neighbours=Neighbours(0.0))
    assert {t for _, p, t in clock.calls if p == "mkl"} == {t for t in choice.BUCKETS
                                                            if choice.MEMORY_BOUND_TOKENS < t <= 64}
    assert [c.table for c in made] == [[(16, "int8"), (64, "mkl")]]
