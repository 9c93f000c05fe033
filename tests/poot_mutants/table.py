"""The table of deliberately broken servers in conformance/README.md, made from the registry.

    python -m poot_mutants.table           # prints the table
    python -m poot_mutants.table --write   # rewrites it in conformance/README.md
"""

from __future__ import annotations

import sys
from pathlib import Path

from .registry import MUTANTS

README = Path(__file__).resolve().parents[2] / "conformance" / "README.md"
BEGIN = "<!-- mutants: begin (python -m poot_mutants.table --write) -->"
END = "<!-- mutants: end -->"


def table() -> str:
    rows = ["| mutation | breaks | defect | reason it must give | may also fail |", "|---|---|---|---|---|"]
    for m in MUTANTS:
        also = ", ".join(f"`{a}`" for a in m.also) or "-"
        rows.append(f"| `{m.name}` | `{m.breaks}` | {m.does} | \"{m.reason}\" | {also} |")
    return "\n".join(rows)


def rewritten(text: str) -> str:
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


def main(argv: list[str]) -> int:
    if "--write" in argv:
        README.write_text(rewritten(README.read_text()))
    else:
        print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
