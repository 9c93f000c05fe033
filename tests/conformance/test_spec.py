"""The spec files: format, the seed mapping, and the mutation table."""

from __future__ import annotations

from pathlib import Path

import pytest
from poot_mutants import table
from poot_mutants.registry import MUTANTS, PARTS

from poot.conformance.clauses import PROFILES, SOURCES, SpecError, load_sources, load_spec, matches

README = Path(__file__).resolve().parents[2] / "conformance" / "README.md"


def test_every_clause_has_an_id_a_level_and_a_profile():
    spec = load_spec()
    assert len(spec) >= 50
    for clause in spec:
        assert clause.level in clause.requirement
        assert clause.profile in PROFILES
        assert clause.observe


def test_every_seed_sentence_maps_to_existing_clauses():
    spec = load_spec()
    sources = load_sources()
    assert "seed-000" in sources
    for row in sources["seed-000"]:
        assert row["clauses"], f"sentence maps to nothing: {row['said']}"
        unknown = [c for c in row["clauses"] if c not in spec]
        assert not unknown, f"unknown clause ids {unknown} for: {row['said']}"


def test_should_clauses_need_strict():
    spec = load_spec()
    should = [c.id for c in spec if c.level == "SHOULD"]
    assert should and not {c.id for c in spec.select()} & set(should)
    assert set(should) <= {c.id for c in spec.select(strict=True)}


def test_prefix_selection_follows_segments():
    assert matches("api/sse/1", "api/sse")
    assert matches("api/sse/1", "api/sse/1")
    assert matches("api/sse/1", "api")
    assert not matches("api/sse/1", "api/ss")
    assert not matches("api/sse/12", "api/sse/1")


def test_bad_spec_file_is_refused(tmp_path):
    (tmp_path / "api.yaml").write_text(
        "area: api\nclauses:\n  - {id: api/x/1, title: t, level: MUST, requirement: it should, observe: o, profile: core, source: openai}\n")
    with pytest.raises(SpecError, match="MUST"):
        load_spec(tmp_path)


def test_every_mutation_breaks_a_known_clause_within_its_scope():
    spec = load_spec()
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names))
    for m in MUTANTS:
        assert m.breaks in spec and all(c in spec for c in m.also), m.name
        assert any(matches(m.breaks, p) for p in m.prefixes), m.name
        assert m.reason, f"{m.name}: no expected reason"
        assert m.parts and set(m.parts) <= set(PARTS), m.name
        assert m.control in spec and m.control != m.breaks and m.control not in m.also, m.name


def test_every_clause_has_a_mutation_that_breaks_it():
    broken = {m.breaks for m in MUTANTS}
    assert not set(load_spec().clauses) - broken


def test_readme_mutation_table_is_generated_from_the_registry():
    text = README.read_text()
    assert table.rewritten(text) == text, "run: PYTHONPATH=tests python -m poot_mutants.table --write"


def test_every_clause_names_its_source_and_design_choices_are_the_designs():
    spec = load_spec()
    assert {c.source for c in spec} <= set(SOURCES)
    choices = {c.id for c in spec if c.design_choice}
    # the reference design's own choices: reservation at open, no row option, /health, our metric names,
    # a constant compile count
    assert {"loop/reserve/1", "startup/plan/1", "startup/plan/2", "api/health/1", "metrics/names/1",
            "prefix/metrics/1", "compile/constant/1"} <= choices
    assert all(spec[c].source == "design" for c in choices)
    assert {c.id for c in spec if c.profile == "extensions"} == {c.id for c in spec if c.source == "extension"}


def test_a_clause_without_a_source_or_a_choice_of_another_source_is_refused(tmp_path):
    clause = "{id: api/x/1, title: t, level: MUST, requirement: it MUST, observe: o, profile: core"
    (tmp_path / "api.yaml").write_text(f"area: api\nclauses:\n  - {clause}}}\n")
    with pytest.raises(SpecError, match="source"):
        load_spec(tmp_path)
    (tmp_path / "api.yaml").write_text(f"area: api\nclauses:\n  - {clause}, source: openai, design_choice: x}}\n")
    with pytest.raises(SpecError, match="design_choice"):
        load_spec(tmp_path)
