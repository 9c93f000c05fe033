"""The clauses of the spec: loading the YAML files under spec/ and choosing which to run."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

SPEC_DIR = Path(__file__).parent / "spec"
SOURCES_DIR = SPEC_DIR / "sources"
SUITE_DIR = Path(__file__).parent / "suite"

LEVELS = ("MUST", "SHOULD")
PROFILES = ("core", "metrics", "faults", "startup", "prefix", "determinism", "speculative", "sampling", "extensions",
            "structured", "tools", "responses")
# Where a clause's requirement comes from. A failure of a clause sourced from the reference
# design may be another server's own choice rather than a bug; the report counts those apart
# (a clause with a `design_choice` says what other servers do instead).
SOURCES = {
    "openai": "OpenAI's API reference",
    "sse": "the server-sent events format (HTML Living Standard)",
    "design": "the reference design (seed 000: poot-serve's scheduling loop, /health and /metrics)",
    "practice": "continuous-batching serving practice (seed 001)",
    "extension": "an extension of OpenAI's API that servers share (vLLM's sampling parameters, response_format on "
                 "/v1/completions)",
}
NEEDS = ("metrics", "plan", "fault-injection", "server-command", "recurrent-model", "speculative-server", "api-key")
ID_PATTERN = re.compile(r"^[a-z]+(/[a-z0-9-]+)*/[0-9]+$")


class SpecError(ValueError):
    """A spec file that does not follow the clause format."""


@dataclass(slots=True, frozen=True)
class Clause:
    id: str
    title: str
    level: str
    requirement: str
    observe: str
    profile: str
    source: str = "design"
    design_choice: str = ""  # what other servers do instead, where the clause checks a choice of the reference design
    needs: tuple[str, ...] = ()
    area_title: str = ""

    @property
    def area(self) -> str:
        return self.id.split("/", 1)[0]

    @property
    def group(self) -> str:
        """The id without its number: `loop/commit/stop/2` -> `loop/commit/stop`."""
        return self.id.rsplit("/", 1)[0]

    @property
    def strict(self) -> bool:
        return self.level == "SHOULD"


@dataclass(slots=True)
class Spec:
    clauses: dict[str, Clause] = field(default_factory=dict)

    def __iter__(self):
        return iter(self.clauses.values())

    def __len__(self) -> int:
        return len(self.clauses)

    def __contains__(self, clause_id: object) -> bool:
        return clause_id in self.clauses

    def __getitem__(self, clause_id: str) -> Clause:
        return self.clauses[clause_id]

    def select(self, prefixes: Iterable[str] = (), profiles: Iterable[str] = (),
               strict: bool = False) -> list[Clause]:
        """Clauses matching any prefix (all when none), in the profiles (all when none).

        SHOULD clauses are kept only with `strict`, as h2spec does.
        """
        prefixes, profiles = list(prefixes), set(profiles)
        return [c for c in self
                if (not prefixes or any(matches(c.id, p) for p in prefixes))
                and (not profiles or c.profile in profiles)
                and (strict or not c.strict)]


def matches(clause_id: str, prefix: str) -> bool:
    """Whether `prefix` selects `clause_id`, segment by segment (`api/sse` selects `api/sse/1`)."""
    prefix = prefix.strip("/")
    return clause_id == prefix or clause_id.startswith(prefix + "/")


def _clause(raw: dict, area: str, area_title: str, path: Path) -> Clause:
    missing = {"id", "title", "level", "requirement", "observe", "profile", "source"} - raw.keys()
    if missing:
        raise SpecError(f"{path.name}: clause {raw.get('id', '?')} lacks {sorted(missing)}")
    cid = raw["id"]
    if not ID_PATTERN.match(cid) or cid.split("/", 1)[0] != area:
        raise SpecError(f"{path.name}: bad clause id {cid!r} (want {area}/topic/N)")
    if raw["level"] not in LEVELS:
        raise SpecError(f"{path.name}: {cid}: level must be one of {LEVELS}")
    if raw["level"] not in raw["requirement"]:
        raise SpecError(f"{path.name}: {cid}: the requirement must use the word {raw['level']}")
    if raw["profile"] not in PROFILES:
        raise SpecError(f"{path.name}: {cid}: unknown profile {raw['profile']!r}")
    if raw["source"] not in SOURCES:
        raise SpecError(f"{path.name}: {cid}: unknown source {raw['source']!r} (one of {', '.join(SOURCES)})")
    choice = " ".join(str(raw.get("design_choice") or "").split())
    if choice and raw["source"] != "design":
        raise SpecError(f"{path.name}: {cid}: a design_choice is the reference design's: its source must be design")
    needs = tuple(raw.get("needs", ()))
    if unknown := set(needs) - set(NEEDS):
        raise SpecError(f"{path.name}: {cid}: unknown needs {sorted(unknown)}")
    return Clause(id=cid, title=raw["title"], level=raw["level"], requirement=" ".join(raw["requirement"].split()),
                  observe=" ".join(raw["observe"].split()), profile=raw["profile"], source=raw["source"],
                  design_choice=choice, needs=needs, area_title=area_title)


def load_spec(spec_dir: Path = SPEC_DIR) -> Spec:
    spec = Spec()
    for path in sorted(spec_dir.glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        area = doc.get("area")
        if area != path.stem:
            raise SpecError(f"{path.name}: area must be {path.stem!r}, found {area!r}")
        for raw in doc.get("clauses", []):
            clause = _clause(raw, area, doc.get("title", area), path)
            if clause.id in spec.clauses:
                raise SpecError(f"{path.name}: duplicate clause id {clause.id}")
            spec.clauses[clause.id] = clause
    return spec


def load_sources(sources_dir: Path = SOURCES_DIR) -> dict[str, list[dict]]:
    """Mapping tables: source name -> [{said, clauses}] (paraphrased sentences -> clause ids)."""
    return {p.stem: yaml.safe_load(p.read_text())["sentences"] for p in sorted(sources_dir.glob("*.yaml"))}
