"""Constrained decoding (engine/grammar.py): what the loop keeps matches the request's
grammar, whatever the sampling, the batch, n or speculative decoding; grammars are compiled
once per schema and bad schemas are refused naming response_format."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poot.engine import SamplingParams
from poot.engine.grammar import Grammars
from poot.engine.models.byte_tokenizer import EOS_ID, ByteTokenizer
from poot.engine.params import InvalidRequest
from poot.engine.speculative import make_draft_policy

from .harness import cached_model, greedy, make_engine, run_until_idle

# A finite language: every document is short, so every constrained answer must end "stop"
# well inside max_tokens, and a random model cannot wander into a long number.
SMALL = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"}},
         "required": ["kind", "ok"], "additionalProperties": False}
MAX_TOKENS = 48

GRAMMARS = Grammars(ByteTokenizer())


def submit_with(engine, prompt, params, schema=SMALL, n=1):
    from .harness import Record

    recs = [Record() for _ in range(n)]
    grammar = GRAMMARS.json_schema(schema)
    engine.submit_choices(prompt, params, recs, [grammar.matcher() for _ in range(n)])
    return recs


def assert_matches(rec, schema=SMALL):
    assert rec.finished.reason == "stop", f"ended {rec.finished.reason!r} after {len(rec.token_ids)} tokens: {rec.text!r}"
    # The request ends on the token that makes the document whole: nothing but
    # end-of-sequence could follow, so no step is spent picking it.
    assert EOS_ID not in rec.token_ids
    jsonschema.validate(json.loads(rec.text), schema)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), temperature=st.sampled_from([0.0, 0.7, 1.0, 1.8]),
       top_p=st.sampled_from([1.0, 0.9]), prompt=st.text(alphabet="abc{}\" ", min_size=1, max_size=12))
def test_every_sampled_answer_is_a_document_the_schema_accepts(seed, temperature, top_p, prompt):
    engine = make_engine()
    [rec] = submit_with(engine, prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, top_p=top_p,
                                                       seed=seed))
    run_until_idle(engine)
    assert_matches(rec)


def test_without_the_grammar_the_same_request_is_not_json():
    # The model alone: if this were JSON, the test above would prove nothing.
    engine = make_engine()
    from .harness import submit

    rec, _ = submit(engine, "abc", greedy(MAX_TOKENS))
    run_until_idle(engine)
    with pytest.raises(ValueError):
        json.loads(rec.text)


def test_a_constrained_row_leaves_its_neighbours_alone():
    """Masks are per row: the free rows of a batch sample exactly what they sample alone."""
    from .harness import submit

    prompts = ["one", "two words", "three more words"]
    alone = []
    for p in prompts:
        engine = make_engine()
        rec, _ = submit(engine, p, greedy(24))
        run_until_idle(engine)
        alone.append(rec.token_ids)
    engine = make_engine()
    free = [submit(engine, p, greedy(24))[0] for p in prompts[:2]]
    [constrained] = submit_with(engine, prompts[2], greedy(MAX_TOKENS))
    free.append(submit(engine, prompts[2], greedy(24))[0])
    run_until_idle(engine)
    assert [r.token_ids for r in free] == alone
    assert_matches(constrained)


def test_each_choice_of_n_has_its_own_matcher():
    engine = make_engine()
    recs = submit_with(engine, "pets", SamplingParams(max_tokens=MAX_TOKENS, temperature=1.5, seed=7), n=4)
    run_until_idle(engine)
    for rec in recs:
        assert_matches(rec)
    assert len({rec.text for rec in recs}) > 1, "four sampled choices at temperature 1.5 all alike"


def test_accepted_drafts_are_picked_under_the_grammar():
    """With speculative decoding a draft is kept only where the grammar's masked pick equals
    it, so greedy output is token for token the output without drafts."""
    schema = {"type": "object", "properties": {"a": {"enum": ["abcabcabc", "abcabd"]}, "b": {"enum": ["abcabc"]}},
              "required": ["a", "b"], "additionalProperties": False}
    outputs = {}
    for draft in (None, "ngram"):
        engine = make_engine()
        if draft:
            engine.scheduler.draft_policy = make_draft_policy(draft)
        [rec] = submit_with(engine, "abcabcabc abcabc", greedy(MAX_TOKENS), schema)
        run_until_idle(engine)
        assert_matches(rec, schema)
        outputs[draft] = rec.token_ids
        if draft:
            assert engine.counters["spec_accepted"] > 0, "no draft was accepted: the check proves nothing"
    assert outputs["ngram"] == outputs[None]


def test_a_grammar_ends_the_request_when_the_document_is_whole_even_with_ignore_eos():
    engine = make_engine()
    [rec] = submit_with(engine, "x", greedy(MAX_TOKENS, ignore_eos=True))
    run_until_idle(engine)
    assert_matches(rec)


def test_max_tokens_cuts_a_document_short_with_length():
    engine = make_engine()
    [rec] = submit_with(engine, "x", greedy(5))
    run_until_idle(engine)
    assert rec.finished.reason == "length"
    assert len(rec.token_ids) == 5
    assert rec.text.startswith("{")


def test_the_matcher_allows_exactly_what_consuming_accepts():
    grammar = GRAMMARS.json_schema(SMALL)
    matcher = grammar.matcher()
    allowed = matcher.allowed()
    assert allowed.shape == (ByteTokenizer.vocab_size,)
    assert np.flatnonzero(allowed).tolist() == [ord("{")]
    logits = np.zeros(ByteTokenizer.vocab_size + 6, np.float32)  # a head padded past the vocabulary
    masked = matcher.mask(logits)
    assert np.flatnonzero(np.isfinite(masked)).tolist() == [ord("{")]
    for b in b'{"kind": "dog", "ok": true':
        assert matcher.allowed()[b], chr(b)
        matcher.consume(b)
        assert not matcher.done
    assert np.flatnonzero(matcher.allowed()).tolist() == [ord("}")]
    matcher.consume(ord("}"))
    assert matcher.done and matcher.error() == ""  # whole: only end-of-sequence could follow
    assert np.flatnonzero(matcher.allowed()).tolist() == [EOS_ID]


def test_a_token_the_grammar_forbids_ends_the_matcher_in_error():
    matcher = GRAMMARS.json_schema(SMALL).matcher()
    matcher.consume(ord("x"))
    assert matcher.done and matcher.error()


def test_a_schema_is_compiled_once_and_each_matcher_starts_fresh():
    g = Grammars(ByteTokenizer())
    a = g.json_schema(SMALL)
    assert g.json_schema(json.loads(json.dumps(SMALL))) is a  # the same schema, another dict
    first, second = a.matcher(), a.matcher()
    first.consume(ord("{"))
    assert np.flatnonzero(second.allowed()).tolist() == [ord("{")]
    assert g.json_object() is g.json_schema({"type": "object"})


@pytest.mark.parametrize("schema, says", [
    ({"type": "no-such-type"}, "cannot be compiled"),
    ({"type": "string", "pattern": "(?<=a)b"}, "cannot be compiled"),  # look-behind: not a regular language
    ({"$ref": "https://example.com/elsewhere.json"}, "cannot be compiled"),
    ({"type": "array", "uniqueItems": True}, "Unimplemented keys"),  # what llguidance cannot enforce
    ({"not": {"type": "string"}}, "Unimplemented keys"),
    ({"type": "string", "format": "no-such-format"}, "Unknown format"),
    ([1, 2], "must be a JSON object"),
    ({"type": "number", "minimum": float("nan")}, "not JSON"),
])
def test_a_schema_that_cannot_be_served_is_refused_naming_response_format(schema, says):
    with pytest.raises(InvalidRequest) as e:
        GRAMMARS.json_schema(schema)
    assert e.value.param == "response_format"
    assert says in str(e.value)


def test_the_byte_vocabulary_is_the_models():
    tokenizer = GRAMMARS.tokenizer()
    assert tokenizer.vocab_size == cached_model(0).tokenizer.vocab_size


def test_a_vocabulary_llguidance_cannot_read_refuses_constrained_requests_naming_response_format():
    class Unreadable(ByteTokenizer):
        def token_bytes(self, token_id: int) -> bytes:
            raise ValueError("token table damaged")

    g = Grammars(Unreadable())
    for _ in range(2):  # tried once, then the reason is kept
        with pytest.raises(InvalidRequest) as e:
            g.json_object()
        assert e.value.param == "response_format" and "token table damaged" in str(e.value)


def test_closing_a_schema_only_narrows_what_it_accepts():
    from poot.engine.grammar import closed

    schema = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"a": {"type": "integer"}}},
                                               "list": {"type": "array", "items": {"properties": {"b": {}}}}},
              "$defs": {"d": {"properties": {"c": {}}}}, "anyOf": [{"properties": {"x": {}}}, {"type": "object"}]}
    shut = closed(schema)
    assert shut["additionalProperties"] is False
    assert set(shut["properties"]) == {"properties", "list"}  # a property named "properties" is a property
    assert shut["properties"]["properties"]["additionalProperties"] is False
    assert shut["properties"]["list"]["items"]["additionalProperties"] is False
    assert shut["$defs"]["d"]["additionalProperties"] is False
    assert shut["anyOf"][0]["additionalProperties"] is False and "additionalProperties" not in shut["anyOf"][1]
    left = {"properties": {"a": {}}, "additionalProperties": {"type": "string"}}
    assert closed(left) == left
    doc = {"properties": {"a": 1}, "list": [{"b": 2}]}
    jsonschema.validate(doc, shut)
    jsonschema.validate(doc, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**doc, "extra": 1}, shut)


def test_properties_are_written_in_the_order_the_schema_names_them():
    schema = {"type": "object", "properties": {"zebra": {"enum": [1]}, "apple": {"enum": [2]}},
              "required": ["zebra", "apple"]}
    engine = make_engine()
    [rec] = submit_with(engine, "x", greedy(MAX_TOKENS), schema)
    run_until_idle(engine)
    assert rec.text == '{"zebra": 1, "apple": 2}'


def test_a_grammar_is_started_once_by_the_given_runner_and_its_matchers_are_copies():
    """The long part of a compile runs where the server says (its lower-priority thread);
    a schema found compiled starts nothing; each matcher moves on its own."""
    ran = []
    g = Grammars(ByteTokenizer(), start=lambda work: ran.append(1) or work())
    grammar = g.json_schema(SMALL)
    g.json_schema(SMALL)
    assert ran == [1]
    one, two = grammar.matcher(), grammar.matcher()
    for byte in b'{"kind": "cat"':
        one.consume(byte)
    assert one.allowed()[ord(",")] and not one.allowed()[ord("{")]
    assert two.allowed()[ord("{")] and not two.allowed()[ord(",")]
