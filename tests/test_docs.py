"""The docs state facts the code also states; these tests fail when the two part.

docs/contracts.md is checked name by name against the engine, drivers and server: every
`Class(field, ...)` it writes lists the class's fields, every `engine.x`, `driver.x`,
`Class.x` it names exists, its imports import, its backends and options are the code's. The
README's backends table and layout, and every relative link in the docs, are checked too.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import subprocess
from pathlib import Path

import pytest

from poot.engine import Engine, SamplingParams, engine, events, grammar, ops, plan, step
from poot.engine.drivers import BACKENDS
from poot.engine.drivers.base import Driver

ROOT = Path(__file__).resolve().parents[1]
CONTRACTS = ROOT / "docs" / "contracts.md"
SERVER_README = ROOT / "server" / "README.md"
README = ROOT / "README.md"
DOCS = [README, SERVER_README, ROOT / "conformance" / "README.md", ROOT / "loadtests" / "README.md",
        *sorted((ROOT / "docs").rglob("*.md"))]

# Where the classes the contracts name are defined.
CLASSES = {name: obj for module in (events, step, ops, plan, engine, grammar)
           for name, obj in vars(module).items() if inspect.isclass(obj) and obj.__module__ == module.__name__}
CLASSES |= {"Engine": Engine, "SamplingParams": SamplingParams, "Driver": Driver}
# What the contracts call an engine, a driver, ...: the class each stands for.
INSTANCES = {"engine": Engine, "driver": Driver, "handle": events.RequestHandle, "plan": plan.Plan,
             "params": SamplingParams, "ops": ops}


def has_name(owner, name: str) -> bool:
    """A class attribute, or an instance attribute its methods set (self.name = ...)."""
    if hasattr(owner, name):
        return True
    if not inspect.isclass(owner):
        return False
    return any(re.search(rf"\bself\.{name}\s*[:=]", inspect.getsource(c))
               for c in owner.__mro__ if c.__module__.startswith("poot."))


def fields_of(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def test_backends_lists_are_the_codes():
    text = CONTRACTS.read_text()
    made = re.search(r"make_driver\(([^)]*)\)", text)
    assert made, "docs/contracts.md no longer shows make_driver(...)"
    lists = {"make_driver": re.findall(r'"(\w+)"', made.group(1)),
             "poot-serve --backend": re.search(r"--backend ([\w|]+)", text).group(1).split("|")}
    for where, names in lists.items():
        assert tuple(names) == BACKENDS, (
            f"docs/contracts.md's {where} lists {names}; engine/drivers/__init__.py has {list(BACKENDS)}")
    row = next(line for line in SERVER_README.read_text().splitlines() if line.startswith("| `--backend"))
    missing = [b for b in BACKENDS if f"`{b}`" not in row]
    assert not missing, f"server/README.md's --backend row does not name {missing}"
    table = re.findall(r"^\| `(\w+)` \|", section(README.read_text(), "Running the reference server"), re.M)
    assert tuple(table) == tuple(b for b in BACKENDS if b != "auto"), (
        f"README.md's backends table has rows {table}; the code has {[b for b in BACKENDS if b != 'auto']}")


def test_every_class_the_contracts_write_out_has_those_fields():
    text = CONTRACTS.read_text()
    seen = 0
    for name, args in re.findall(r"\b([A-Z]\w*)\(([^()]*)\)", text):
        assert name in CLASSES, f"docs/contracts.md writes {name}(...), which the engine does not define"
        cls = CLASSES[name]
        if not dataclasses.is_dataclass(cls):
            continue
        seen += 1
        named = [a.split("=")[0].strip() for a in args.split(",") if a.strip() and a.strip() != "..."]
        if any("=" in a for a in args.split(",")):  # keyword form: the fields it names exist
            wrong = [n for n in named if n not in fields_of(cls)]
            assert not wrong, f"docs/contracts.md's {name}(...) names {wrong}; {name} has {fields_of(cls)}"
        else:
            assert named == fields_of(cls), (
                f"docs/contracts.md writes {name}({', '.join(named)}); the code has {name}({', '.join(fields_of(cls))})")
    assert seen >= 10, f"only {seen} field lists found in docs/contracts.md"


def test_every_attribute_the_contracts_name_exists():
    text = CONTRACTS.read_text()
    named = [(CLASSES[c], c, a) for c, a in re.findall(r"\b([A-Z]\w*)\.(\w+)", text) if c in CLASSES]
    named += [(INSTANCES[o], o, a) for o, a in re.findall(r"(?<![\w./])(\w+)\.([a-zA-Z_]\w*)", text) if o in INSTANCES]
    assert len(named) >= 20
    missing = sorted({f"{o}.{a}" for owner, o, a in named if not has_name(owner, a)})
    assert not missing, f"docs/contracts.md names {missing}, which the code does not have"


def test_keyword_arguments_the_contracts_show_are_taken():
    from poot.server import cli

    text = CONTRACTS.read_text()
    create = re.search(r"Engine\.create\(([^()]*)\)\s*\n", text).group(1)
    taken = set(inspect.signature(Engine.create).parameters) | set(inspect.signature(Engine.__init__).parameters)
    wrong = [k for k in re.findall(r"(\w+)=", create) if k not in taken]
    assert not wrong, f"docs/contracts.md passes Engine.create {wrong}, which it does not take"
    main = re.search(r"poot\.server\.cli\.main\(([^()]*)\)", text).group(1)
    shown = [a.split("=")[0].strip() for a in main.split(",")]
    assert shown == list(inspect.signature(cli.main).parameters), (
        f"docs/contracts.md shows main({shown}); server/cli.py has {list(inspect.signature(cli.main).parameters)}")


def test_the_contracts_imports_import():
    imports = re.findall(r"^from (poot\.[\w.]+) import ([\w, ]+)", CONTRACTS.read_text(), re.M)
    assert imports
    for module, names in imports:
        mod = importlib.import_module(module)
        missing = [n.strip() for n in names.split(",") if not hasattr(mod, n.strip())]
        assert not missing, f"docs/contracts.md imports {missing} from {module}, which has no such names"


def test_the_op_vocabulary_is_the_codes():
    lines = CONTRACTS.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if "stated in `ops.VOCABULARY`" in line)
    listed = re.findall(r"`(\w+)`", lines[at + 1])
    assert sorted(listed) == sorted(ops.VOCABULARY), (
        f"docs/contracts.md lists the ops {listed}; engine/ops.py's VOCABULARY has {list(ops.VOCABULARY)}")


def serve_options() -> set[str]:
    import argparse

    from poot.server.cli import build_parser

    return {o for a in build_parser()._actions if a.help != argparse.SUPPRESS
            for o in a.option_strings if o.startswith("--") and o != "--help"}


def test_poot_serve_options_are_the_parsers():
    text = CONTRACTS.read_text()
    line = re.search(r"`poot-serve (--model .*?)`", text, re.S).group(1)
    assert set(re.findall(r"--[\w-]+", line)) == serve_options(), (
        f"docs/contracts.md's poot-serve options differ from server/cli.py's: {sorted(serve_options())}")
    table = section(SERVER_README.read_text(), "Starting it")
    documented = {o for row in re.findall(r"^\| (`--[^|]*)\|", table, re.M) for o in re.findall(r"--[\w-]+", row)}
    assert documented == serve_options(), (
        f"server/README.md's options table has {sorted(documented)}; server/cli.py has {sorted(serve_options())}")


def section(text: str, title: str) -> str:
    """The body of the Markdown section with this heading (any level), up to the next of its level."""
    # headings are looked for outside fenced code, where a shell comment starts with # too
    prose = re.sub(r"```.*?```", lambda m: re.sub(r"[^\n]", " ", m.group()), text, flags=re.S)
    match = re.search(rf"^(#+) {re.escape(title)}\s*$", prose, re.M)
    assert match, f"no section {title!r}"
    end = re.compile(rf"^#{{1,{len(match.group(1))}}} ", re.M).search(prose, match.end())
    return text[match.end(): end.start() if end else len(text)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md":
            prose = re.sub(r"```.*?```", "", file.read_text(), flags=re.S)
            anchors = {slug(h) for h in re.findall(r"^#+ (.*)$", prose, re.M)}
            if anchor not in anchors:
                broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)} links to what is not there: {broken}"


def test_the_layout_names_every_top_level_folder():
    tracked = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    folders = {p.split("/")[0] for p in tracked.splitlines() if "/" in p and not p.startswith(".")}
    layout = section(README.read_text(), "Working on poot")
    listed = set(re.findall(r"^\| `([\w-]+)/` \|", layout, re.M))
    assert listed == folders, (f"README.md's layout lists {sorted(listed)}; the tree's top-level folders are "
                               f"{sorted(folders)}")
    assert all((ROOT / f).is_dir() for f in listed)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_files_the_docs_name_are_in_the_tree(doc):
    """A path in backticks (`cpu/products/choice.py`) names a file the tree holds: the tail of
    some tracked file's path, so a doc may name it from its folder down."""
    tracked = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    files = set(tracked.splitlines())
    folders = {str(Path(f).parents[i]) for f in files for i in range(len(Path(f).parents) - 1)}
    # a file (with its suffix) or a folder (with its slash); clause ids such as api/sse/1 are neither
    named = re.findall(r"`([\w.-]+(?:/[\w.-]+)*(?:\.[a-z]+|/))`", doc.read_text())
    named = [n for n in named if "/" in n]

    def there(path: str) -> bool:
        path = path.rstrip("/")
        return any(f == path or f.endswith("/" + path) for f in files | folders)

    missing = sorted({p for p in named if not there(p)})
    assert not missing, f"{doc.relative_to(ROOT)} names {missing}, which the tree does not hold"
