"""Starts the reference server with deliberate defects:

    python -m poot_mutants.serve --mutation NAME [--mutation NAME ...] [poot-serve options]

(with tests/ on PYTHONPATH). An unknown name fails start-up with exit status 2, so a run
never passes against a server that silently left its defect out.
"""

from __future__ import annotations

import argparse
import logging
import sys

from poot.engine import Engine
from poot.server import cli
from poot.server.app import build_app
from poot.server.auth import RequireKey
from poot.server.state import ServerState, slowed

from .registry import BY_NAME, PARTS


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the --mutation names, every other argument)."""
    names, rest, it = [], [], iter(argv)
    for a in it:
        if a == "--mutation":
            names.append(next(it, ""))
        elif a.startswith("--mutation="):
            names.append(a.split("=", 1)[1])
        else:
            rest.append(a)
    return names, rest


def collect(names: list[str]) -> dict[str, list]:
    """For each part, the replacements the named defects bring (in order)."""
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise ValueError(f"unknown mutation(s): {', '.join(unknown)}; known: {', '.join(sorted(BY_NAME))}")
    parts: dict[str, list] = {p: [] for p in PARTS}
    for n in names:
        for part, value in BY_NAME[n].parts.items():
            if value not in parts[part]:
                parts[part].append(value)
    return parts


def combined(base: type, classes: list[type]) -> type:
    """One class with every replacement's overrides (each a subclass of `base`)."""
    if not classes:
        return base
    if len(classes) == 1:
        return classes[0]
    return type("_".join(c.__name__ for c in classes), tuple(classes), {})


def state_class(parts: dict[str, list]) -> type[ServerState]:
    from poot.engine.drivers.cpu import CpuDriver
    from poot.engine.prefix_cache import PrefixCache
    from poot.engine.scheduler import Scheduler
    from poot.engine.stops import StopChecker

    engine = combined(Engine, parts["engine"])
    engine_parts = {}
    for name, base in (("scheduler", Scheduler), ("prefix_cache", PrefixCache), ("stop_checker", StopChecker)):
        if parts[name]:
            engine_parts[name] = combined(base, parts[name])
    if parts["random_stream"]:
        engine_parts["random_stream"] = parts["random_stream"][-1]
    driver = combined(CpuDriver, parts["driver"]) if parts["driver"] else None

    class Mutated(combined(ServerState, parts["state"])):
        def make_driver(self):
            if driver is None:
                return super().make_driver()
            d = driver()
            return slowed(d, self.step_delay) if self.step_delay > 0 else d

        def make_engine(self, model):
            return engine.create(model, draft=self.draft, driver=self.make_driver(), **engine_parts)

    return Mutated


def app_factory(parts: dict[str, list], outer=None):
    def build(state):
        app = build_app(state)
        for middleware in parts["middleware"]:
            app = middleware(app, state)
        return outer(app) if outer is not None else app

    return build


def main(argv: list[str] | None = None, outer=None) -> int:
    """Runs the server with the named defects; `outer` (app -> ASGI app), when given, wraps
    the whole app, defects included (a test-only view such as an OpenAI-only server)."""
    names, rest = split_argv(sys.argv[1:] if argv is None else argv)
    try:
        parts = collect(names)
    except ValueError as e:
        print(f"poot_mutants.serve: error: {e}", file=sys.stderr, flush=True)
        return 2
    parser = cli.build_parser(combined(argparse.ArgumentParser, parts["parser"]))
    logging.getLogger("poot.server").warning("deliberate defects on: %s", ", ".join(names) or "none")
    key_guard = combined(RequireKey, parts["key_guard"]) if parts["key_guard"] else None
    return cli.main(rest, parser=parser, state_class=state_class(parts), app_factory=app_factory(parts, outer),
                    key_guard=key_guard)


if __name__ == "__main__":
    sys.exit(main())
