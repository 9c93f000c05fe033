"""Speculative decoding: a draft policy of the driver; greedy output identical to plain
decoding, sampled output keeping the target distribution, stop rules inside a round, KV
rollback of rejected positions, constant compiles, and the spec_* counters."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poot.engine import Engine, SamplingParams
from poot.engine.drivers.cpu import CpuDriver
from poot.engine.models.synthetic import synthetic_llama
from poot.engine.sampler import probabilities, sample
from poot.engine.speculative import DraftPolicy, NgramPolicy, lookup, make_draft_policy
from poot.engine.step import RowWork, StepPlan

from .harness import greedy, make_engine, submit

# ---- helpers ----------------------------------------------------------------------------


class CheckingDriver(CpuDriver):
    """A NumPy driver that checks every row it is fed stays inside the positions reserved at
    open (prompt + max_tokens) and inside its block table."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.engine: Engine | None = None
        self.max_feed = 0

    def run_step(self, step, batch):
        if self.engine is None:  # the warm-up steps of preparing, before any request exists
            return super().run_step(step, batch)
        reserved = {q.row: q.num_reserved_tokens for q in self.engine.scheduler.running}
        for w in batch:
            end = w.start + len(w.tokens)
            assert end <= len(w.block_table) * self.plan.block_size
            assert end <= reserved[w.row], (w.row, w.start, len(w.tokens), reserved[w.row])
            self.max_feed = max(self.max_feed, len(w.tokens) if w.num_logits == len(w.tokens) else 0)
        return super().run_step(step, batch)


def engine_with(policy: DraftPolicy | None, seed: int = 0) -> Engine:
    driver = CheckingDriver(memory_bytes=1 << 30)
    engine = Engine.create(synthetic_llama(seed), driver=driver)
    engine.scheduler.draft_policy = policy
    driver.engine = engine
    return engine


def run(engine: Engine, requests: list[tuple[object, SamplingParams]]):
    """Runs the requests to the end, checking after every iteration that each decoding row's
    KV length is exactly its tokens less the last (rejected drafts rolled back)."""
    recs = [submit(engine, p, params)[0] for p, params in requests]
    for _ in range(20_000):
        if not engine.in_flight():
            break
        engine.iteration()
        for seq in engine.scheduler.running:
            if seq.output:
                assert seq.num_computed == len(seq.tokens) - 1
    assert not engine.in_flight()
    return recs


def outcome(rec):
    return rec.token_ids, rec.text, rec.finished.reason, rec.finished.completion_tokens


class OraclePolicy(DraftPolicy):
    """Drafts the plain-decoding continuation of each prompt (so long runs are accepted and
    cross EOS, stop strings and max_tokens), corrupted at a position chosen by the sequence,
    and padded past its end with junk."""

    name = "oracle"

    def __init__(self, k: int = 6):
        self.k = k
        self.reference: dict[tuple[int, ...], list[int]] = {}

    def propose(self, seq, room, num_decoding_rows):
        ref = self.reference.get(tuple(seq.prompt), [])
        j = len(seq.output)
        drafts = (ref[j : j + self.k] + [65, 66, 67, 68, 69, 70, 71, 72])[: self.k + 3]  # over-long on purpose
        bad = (len(seq.prompt) * 7 + j * 3) % (2 * self.k)
        if bad < len(drafts):
            drafts[bad] = (drafts[bad] + 1) % 256
        return drafts


def chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for X chi-square with dof degrees of freedom (regularized upper gamma)."""
    a, x = dof / 2.0, x / 2.0
    if x <= 0:
        return 1.0
    if math.isinf(x):
        return 0.0
    lead = math.exp(-x + a * math.log(x) - math.lgamma(a))
    if x < a + 1:  # series for the lower tail
        term = total = 1.0 / a
        n = a
        for _ in range(10_000):
            n += 1
            term *= x / n
            total += term
            if term < total * 1e-15:
                break
        return max(0.0, 1.0 - total * lead)
    # continued fraction for the upper tail (Lentz)
    b, c, d = x + 1 - a, 1e300, 1 / (x + 1 - a)
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1e-300 if abs(d) < 1e-300 else d
        c = b + an / c
        c = 1e-300 if abs(c) < 1e-300 else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return lead * h


def chi_square(counts: np.ndarray, expected_p: np.ndarray) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom, pooling categories expected below 5."""
    if (counts[expected_p == 0] > 0).any():
        return math.inf, 1  # a token the target never gives
    n = counts.sum()
    exp = expected_p * n
    small = exp < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(exp[~small], exp[small].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    return float(((obs - exp) ** 2 / exp).sum()), int(len(obs) - 1)


# ---- the policy ---------------------------------------------------------------------------


def test_lookup_takes_the_longest_suffix_and_its_latest_earlier_occurrence():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert lookup(tokens, 3, 2, 4) == [7, 8, 5]  # "2 3" latest earlier at index 5
    assert lookup(tokens, 3, 1, 1) == [7, 8, 5]
    assert lookup([1, 2, 3, 1, 2], 4, 2, 4) == [3, 1, 2]  # runs up to the end
    assert lookup([1, 2, 3, 4], 3, 1, 4) == []  # nothing repeats
    assert lookup([5, 5, 5], 2, 2, 3) == [5]  # overlapping occurrence
    assert lookup([1], 3, 1, 3) == []


_ids = iter(range(10**6))


def _seq(tokens, output_len, max_tokens, request_id=None):
    class S:
        pass

    s = S()
    s.request_id = next(_ids) if request_id is None else request_id
    s.output = tokens[len(tokens) - output_len :]
    s.prompt = tokens[: len(tokens) - output_len]
    s.tokens = tokens
    s.params = SamplingParams(max_tokens=max_tokens)
    return s


def test_ngram_policy_respects_room_and_max_tokens_and_drafts_less_when_the_batch_is_full():
    policy = make_draft_policy("ngram")
    tokens = list(range(30)) * 2 + [0, 1, 2]  # quoting: the suffix continues 3, 4, 5, ...
    assert policy.propose(_seq(tokens, 1, 100), 100, 1) == list(range(3, 3 + policy.max_drafts))
    assert policy.propose(_seq(tokens, 1, 100), 2, 1) == [3, 4]
    assert policy.propose(_seq(tokens, 5, 8), 100, 1) == [3, 4]  # 8 - 5 - 1
    assert policy.propose(_seq(tokens, 5, 6), 100, 1) == []
    assert policy.propose(_seq(tokens, 1, 100), 100, policy.full_rows) == []  # full batch: plain decoding
    some = NgramPolicy(min_ngram=2, full_drafts=2, full_min_ngram=3)
    assert some.propose(_seq(tokens, 1, 100), 100, 32) == [3, 4]
    short = [1, 2, 9, 8, 7, 6, 1, 2]  # only a 2-token match
    assert some.propose(_seq(short, 1, 100), 100, 1) == [9, 8, 7, 6, 1, 2]
    assert some.propose(_seq(short, 1, 100), 100, 32) == []
    assert policy.propose(_seq(short, 1, 100), 100, 1) == []  # the default needs 3


def test_ngram_policy_backs_off_after_rejected_rounds_and_resets_on_an_accepted_draft():
    policy = NgramPolicy(min_ngram=1, min_acceptance=0)
    base = [5, 6, 7, 8] * 4

    def at(n_out):  # the same request, after n_out outputs (always quoting, so a match exists)
        return policy.propose(_seq(base + [5] * n_out, n_out, 1000, request_id=7), 100, 1)

    assert at(1)  # drafts
    assert not at(2)  # round committed 1 token: all rejected -> wait 1 step
    assert at(3)
    assert not at(4) and not at(5)  # second miss in a row -> wait 2
    assert at(6)
    assert at(9)  # that round committed 3 tokens: accepted -> no wait
    assert not at(10) and at(11)  # a miss after a success waits 1 step again


def test_ngram_policy_counts_a_mostly_rejected_round_as_a_miss():
    policy = NgramPolicy(min_ngram=1, max_drafts=8)  # min_acceptance 0.5 by default
    base = list(range(100, 120))

    def at(n_out):  # the answer quotes base from its start: a match always exists
        return policy.propose(_seq(base + base[:n_out], n_out, 1000, request_id=9), 100, 1)

    assert len(at(1)) == 8
    assert not at(4)  # 2 of 8 drafts accepted (3 tokens committed): under half -> wait 1 step
    assert len(at(5)) == 8
    assert at(10)  # 4 of 8 accepted: enough, no wait


def test_make_draft_policy_and_the_scheduler_owns_it():
    assert isinstance(make_draft_policy("ngram"), NgramPolicy)
    with pytest.raises(ValueError, match="unknown draft policy"):
        make_draft_policy("eagle")
    engine = make_engine(draft="ngram")
    assert isinstance(engine.scheduler.draft_policy, NgramPolicy)
    assert engine.draft_policy is engine.scheduler.draft_policy
    assert not hasattr(engine.driver, "draft_policy"), "nothing of the policy's reaches the driver"
    assert make_engine(draft="none").scheduler.draft_policy is None
    assert make_engine().scheduler.draft_policy is None  # off by default


# ---- greedy: identical to plain decoding ---------------------------------------------------

_engines: dict[str, Engine] = {}
_prepared_compiles: dict[str, int] = {}  # the compile count right after prepare


def _engine(name: str) -> Engine:
    if name not in _engines:
        eager = NgramPolicy(min_ngram=1, max_backoff=1, full_drafts=4)  # drafts as often as it can
        policy = {"plain": None, "ngram": eager, "oracle": OraclePolicy()}[name]
        _engines[name] = engine_with(policy)
        _prepared_compiles[name] = _engines[name].metrics()["engine_compiles"]
    return _engines[name]


alphabet = st.sampled_from(list("ab c\n{}'WO5y$rd.N*Kg"))
prompt_st = st.builds(lambda a, b, reps: a + b * reps, st.text(alphabet, max_size=12),
                      st.text(alphabet, min_size=1, max_size=10), st.integers(1, 4))
params_st = st.builds(
    lambda max_tokens, stop, ignore_eos: greedy(max_tokens, stop=tuple(stop), ignore_eos=ignore_eos),
    st.integers(1, 40), st.lists(st.text(alphabet, min_size=1, max_size=3), max_size=2), st.booleans())


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(prompt_st, params_st), min_size=1, max_size=4, unique_by=lambda r: r[0]))
def test_speculative_greedy_output_equals_plain_greedy_output(requests):
    plain = [outcome(r) for r in run(_engine("plain"), requests)]
    oracle = _engine("oracle")
    oracle.scheduler.draft_policy.reference = {
        tuple(oracle.model.encode_prompt(p)): out[0] for (p, _), out in zip(requests, plain, strict=True)}
    for name in ("ngram", "oracle"):
        got = [outcome(r) for r in run(_engine(name), requests)]
        assert got == plain, name
    for name in ("plain", "ngram", "oracle"):
        m = _engine(name).metrics()
        assert m["spec_accepted_tokens"] <= m["spec_drafted_tokens"]
        assert m["engine_compiles"] == _prepared_compiles[name]  # constant however the rows were fed


def test_drafts_past_eos_stop_or_max_tokens_are_cut_inside_the_round():
    prompts = ["abcabc", "hello hello", "x", "{'{'{'{"]
    plain_engine = engine_with(None)
    for stop, ignore_eos, max_tokens in [((), True, 30), ((), False, 30), (("{",), True, 30), (("'{W",), True, 40),
                                         ((), True, 2), ((), True, 1)]:
        reqs = [(p, greedy(max_tokens, stop=stop, ignore_eos=ignore_eos)) for p in prompts]
        plain = [outcome(r) for r in run(plain_engine, reqs)]
        policy = OraclePolicy(k=8)
        engine = engine_with(policy)
        policy.reference = {tuple(engine.model.encode_prompt(p)): o[0] for (p, _), o in zip(reqs, plain, strict=True)}
        assert [outcome(r) for r in run(engine, reqs)] == plain
        m = engine.metrics()
        if max_tokens > 2:
            assert m["spec_rounds"] > 0 and m["spec_accepted_tokens"] > 0
            assert engine.driver.max_feed > 2


def test_counters_count_drafted_accepted_and_rounds():
    class Perfect(OraclePolicy):
        def propose(self, seq, room, rows):
            j = len(seq.output)
            return self.reference[tuple(seq.prompt)][j : j + 3]

    plain_engine = engine_with(None)
    (ref,) = run(plain_engine, [("abc", greedy(13, ignore_eos=True))])
    policy = Perfect()
    engine = engine_with(policy)
    policy.reference = {tuple(engine.model.encode_prompt("abc")): ref.token_ids}
    (rec,) = run(engine, [("abc", greedy(13, ignore_eos=True))])
    assert rec.token_ids == ref.token_ids
    m = engine.metrics()
    # first token from prefill, then rounds of 3 drafts + 1: 4 + 4 + 4 = 12 more tokens
    assert [len(e.token_ids) for e in rec.events if hasattr(e, "token_ids")] == [1, 4, 4, 4]
    assert (m["spec_rounds"], m["spec_drafted_tokens"], m["spec_accepted_tokens"]) == (3, 9, 9)
    assert m["generation_tokens"] == 13


def test_compile_count_is_constant_with_speculation_on():
    engine = engine_with(NgramPolicy(min_ngram=1, full_drafts=3))
    run(engine, [("warm", greedy(2))])
    compiles = engine.driver.compiles
    reqs = [("ab" * (i + 1), greedy(5 + 3 * i, ignore_eos=True)) for i in range(40)]
    reqs += [("quote: x = 1; y = 2; " * 3, SamplingParams(max_tokens=30, temperature=0.8, seed=i)) for i in range(8)]
    run(engine, reqs)
    assert engine.metrics()["spec_rounds"] > 0
    assert engine.driver.compiles == compiles


# ---- sampling: the target distribution is kept -------------------------------------------


def test_sampled_output_with_speculation_is_the_seeded_plain_output():
    """One uniform per committed token, the draw at its output index in the request's
    stream: with a seed, the tokens are the same with speculation on or off (and so
    reproducible)."""
    reqs = [("{'{'{'{'{" * 2, SamplingParams(max_tokens=24, temperature=0.7, seed=s, ignore_eos=True))
            for s in range(12)]
    plain = [r.token_ids for r in run(engine_with(None), reqs)]
    engine = engine_with(make_draft_policy("ngram", min_ngram=1, full_rows=64))
    assert [r.token_ids for r in run(engine, reqs)] == plain
    assert engine.metrics()["spec_accepted_tokens"] > 0


def _verify(p, draft, u):
    """The commit's rule at one position, on a distribution p: inverse CDF, accept iff equal."""
    x = min(int(np.searchsorted(np.cumsum(p), u, side="right")), len(p) - 1)
    return x, x == draft


def test_one_position_accepts_with_probability_p_of_the_draft_and_resamples_the_rest():
    """Rejection sampling for a point-mass draft: P(accept d) = p(d); on rejection the token
    follows p with d removed, renormalized. Fixed seeds; the same statistics reject a wrong
    rule (resampling from p itself on rejection), so they have power."""
    logits = np.random.default_rng(7).standard_normal(12) * 1.5
    params = SamplingParams(temperature=1.0)
    p = probabilities(logits, params)
    n = 20_000
    for draft in (int(np.argmax(p)), int(np.argsort(p)[-4])):
        rng = np.random.default_rng(1234 + draft)
        tokens = np.array([sample(logits, params, rng.random()) for _ in range(n)])
        accepted = tokens == draft
        z = (accepted.sum() - n * p[draft]) / math.sqrt(n * p[draft] * (1 - p[draft]))
        assert abs(z) < 4, z
        residual = np.where(np.arange(len(p)) == draft, 0.0, p)
        residual /= residual.sum()
        stat, dof = chi_square(np.bincount(tokens[~accepted], minlength=len(p)), residual)
        assert chi2_sf(stat, dof) > 1e-3
        # a wrong rule: on rejection draw again from p (the draft can come back)
        wrong = np.array([t if t == draft else sample(logits, params, rng.random()) for t in tokens[:n]])
        wrong_rejected = wrong[~accepted]
        stat, dof = chi_square(np.bincount(wrong_rejected, minlength=len(p)), residual)
        assert chi2_sf(stat, dof) < 1e-6


class ModePolicy(DraftPolicy):
    """Drafts, for every position, a fixed deterministic guess from a precomputed table
    (the target's most or second most likely token): both accepts and rejects happen."""

    name = "mode"

    def __init__(self, table):
        self.table = table  # tuple(tokens) -> list of tokens by decreasing probability

    def propose(self, seq, room, rows):
        ctx, drafts = list(seq.tokens), []
        for _ in range(3):
            ranked = self.table.get(tuple(ctx))
            if ranked is None:
                break
            d = ranked[len(ctx) % 2]
            drafts.append(d)
            ctx.append(d)
        return drafts


def test_sampled_outputs_keep_the_target_distribution():
    """Chi-square of the first four sampled tokens, through the Engine with drafts verified
    at every round, against the exact target distribution computed from the model."""
    params = SamplingParams(max_tokens=4, temperature=1.3, top_k=3, ignore_eos=True)
    model = synthetic_llama(0)
    prompt = model.encode_prompt("ab ab ab")
    probe = CpuDriver(memory_bytes=1 << 30)
    probe_engine = Engine.create(model, driver=probe)
    table = list(range(probe_engine.plan.blocks_for(len(prompt) + 8)))
    probe.step(StepPlan.opening({0: table}))

    def next_p(ctx):
        out = probe.step(StepPlan([RowWork(0, np.array(ctx, np.int32), 0, table, 1)]))
        return probabilities(out.logits[0], params)

    exact: dict[tuple[int, ...], float] = {}
    ranked: dict[tuple[int, ...], list[int]] = {}

    def expand(ctx, prob, depth):
        if depth == params.max_tokens:
            exact[tuple(ctx[len(prompt):])] = prob
            return
        p = next_p(ctx)
        ranked[tuple(ctx)] = [int(t) for t in np.argsort(-p, kind="stable")]
        for t in np.flatnonzero(p > 0):
            expand([*ctx, int(t)], prob * p[t], depth + 1)

    expand(prompt, 1.0, 0)
    assert len(exact) == 3**4 and abs(sum(exact.values()) - 1) < 1e-9

    engine = engine_with(ModePolicy(ranked))
    n = 3000
    recs = run(engine, [(list(prompt), SamplingParams(**{**_as_dict(params), "seed": 10_000 + i}))
                        for i in range(n)])
    keys = list(exact)
    index = {k: i for i, k in enumerate(keys)}
    counts = np.bincount([index[tuple(r.token_ids)] for r in recs], minlength=len(keys))
    stat, dof = chi_square(counts, np.array([exact[k] for k in keys]))
    m = engine.metrics()
    assert m["spec_rounds"] >= n and 0 < m["spec_accepted_tokens"] < m["spec_drafted_tokens"]
    assert chi2_sf(stat, dof) > 1e-3, (stat, dof)


def _as_dict(params: SamplingParams) -> dict:
    return {f: getattr(params, f) for f in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                                            "ignore_eos")}
