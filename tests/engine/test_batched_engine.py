"""Batched equals alone through the whole loop: requests join and leave mid-run, rows sit at
different lengths, prompts are chunked, and each request's tokens are exactly what it gets
when it runs by itself (greedy, and sampled with a seed)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from poot.engine import SamplingParams

from .harness import make_engine, run_until_idle, submit

request_st = st.tuples(
    st.integers(1, 200),  # prompt length
    st.integers(1, 24),  # max_tokens
    st.integers(0, 6),  # iterations to wait before submitting
    st.sampled_from([0.0, 0.9]),  # temperature
)


def params_for(max_tokens, temperature, seed):
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, top_k=40, ignore_eos=True)


def prompt_for(i, n):
    return [(i * 31 + 7 * k) % 256 for k in range(n)]


@settings(max_examples=25, deadline=None)
@given(st.lists(request_st, min_size=2, max_size=10))
def test_each_request_gets_the_same_tokens_batched_as_alone(requests):
    alone = []
    engine = make_engine()
    for i, (n, m, _, temp) in enumerate(requests):
        rec, _ = submit(engine, prompt_for(i, n), params_for(m, temp, i))
        run_until_idle(engine)
        alone.append(rec.token_ids)

    engine = make_engine()
    recs = [None] * len(requests)
    pending = sorted(range(len(requests)), key=lambda i: requests[i][2])
    it = 0
    while pending or engine.in_flight():
        while pending and requests[pending[0]][2] <= it:
            i = pending.pop(0)
            n, m, _, temp = requests[i]
            recs[i], _ = submit(engine, prompt_for(i, n), params_for(m, temp, i))
        engine.iteration()
        it += 1
    assert [r.token_ids for r in recs] == alone
