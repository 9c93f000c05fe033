"""Stop strings across token edges, held-back text, and the sampling rules."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from poot.engine import SamplingParams
from poot.engine.models.byte_tokenizer import ByteTokenizer
from poot.engine.random_stream import random_stream, uniforms
from poot.engine.sampler import probabilities, sample
from poot.engine.stops import StopChecker

decode = ByteTokenizer().decode
text_st = st.text(alphabet=st.sampled_from("ab\n é→"), min_size=0, max_size=40)


def first_completed_stop(text, stops):
    """Where the output is cut: at the start of the first stop string to complete as the
    text grows (the earliest-starting one, if several complete at once)."""
    for end in range(1, len(text) + 1):
        found = [i for s in stops if (i := text[:end].find(s)) >= 0]
        if found:
            return min(found)
    return None


@settings(max_examples=400, deadline=None)
@given(text=text_st, stops=st.lists(st.text(alphabet="ab\né", min_size=1, max_size=4), max_size=3))
def test_streamed_text_is_the_final_text_and_never_holds_a_stop_string(text, stops):
    checker = StopChecker(decode, stops)
    streamed, stopped = "", False
    for byte in text.encode():
        released, stopped = checker.add(byte)
        streamed += released
        if stopped:
            break
    streamed += checker.flush()
    cut = first_completed_stop(text, stops)
    assert streamed == (text if cut is None else text[:cut])
    assert stopped == (cut is not None)
    assert not any(s in streamed for s in stops)


def test_a_stop_string_split_over_tokens_is_held_back_until_it_resolves():
    checker = StopChecker(decode, ["END"])
    out = [checker.add(b)[0] for b in b"abcEN"]
    assert "".join(out) == "abc"  # "EN" could still become "END": held back
    released, stopped = checker.add(ord("D"))
    assert (released, stopped) == ("", True)
    assert checker.final_text() == "abc"


def test_an_incomplete_utf8_character_is_held_back():
    checker = StopChecker(decode, [])
    first, second = "é".encode()
    assert checker.add(first)[0] == ""
    assert checker.add(second)[0] == "é"


def test_top_k_and_top_p_keep_the_smallest_sufficient_set():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    np.testing.assert_allclose(p, [0.5 / 0.8, 0.3 / 0.8, 0, 0])
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.75))
    np.testing.assert_allclose(p, [0.5 / 0.8, 0.3 / 0.8, 0, 0])
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.81))
    np.testing.assert_allclose(p, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])


def test_top_p_keeps_every_token_tied_at_its_cut():
    """The kept set is made of whole probability levels: a token is kept when the tokens
    strictly more likely than it hold less than top_p, so equal logits are kept or cut
    together, whatever their ids (as top-k keeps every token tied with its k-th)."""
    logits = np.log(np.array([0.1, 0.4, 0.1, 0.4]))
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.5))
    np.testing.assert_allclose(p, [0, 0.5, 0, 0.5])
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.85))
    np.testing.assert_allclose(p, [0.1, 0.4, 0.1, 0.4])
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    np.testing.assert_allclose(p, [0, 0.5, 0, 0.5])


def test_temperature_sharpens_and_greedy_takes_the_argmax():
    logits = np.array([1.0, 2.0, 0.5])
    cold = probabilities(logits, SamplingParams(temperature=0.1))
    assert cold[1] > 0.99
    assert sample(logits, SamplingParams(temperature=0.0), 0.999) == 1


def test_a_draw_is_the_inverse_cdf_in_vocabulary_order():
    """One uniform per token: the first token whose cumulative probability, in id order,
    passes it. The same uniform always gives the same token."""
    logits = np.log(np.array([0.6, 0.3, 0.1]))
    params = SamplingParams(temperature=1.0)
    assert [sample(logits, params, u) for u in (0.0, 0.59, 0.61, 0.89, 0.91, 1 - 2**-24)] == [0, 0, 1, 1, 2, 2]


def test_a_seed_makes_sampling_reproducible_and_follows_the_distribution():
    logits = np.log(np.array([0.6, 0.3, 0.1]))
    params = SamplingParams(temperature=1.0, seed=7)
    a = [sample(logits, params, random_stream(7).uniform(k)) for k in range(5)]
    b = [sample(logits, params, random_stream(7).uniform(k)) for k in range(5)]
    assert a == b
    us = uniforms(random_stream(1).key, 0, np.arange(20_000, dtype=np.uint64))
    draws = np.bincount([sample(logits, params, u) for u in us], minlength=3) / 20_000
    np.testing.assert_allclose(draws, [0.6, 0.3, 0.1], atol=0.015)


def test_tokens_with_zero_probability_are_never_drawn():
    logits = np.array([0.0, 5.0, 0.0, 4.0])
    params = SamplingParams(temperature=1.0, top_k=2)
    us = uniforms(random_stream(0).key, 0, np.arange(2000, dtype=np.uint64))
    assert {sample(logits, params, u) for u in us} == {1, 3}
    assert sample(logits, params, 1 - 2**-24) == 3  # a uniform past the last sum takes the last kept token
