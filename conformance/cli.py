"""poot-conformance: run the conformance suite against a server and report clause by clause.

    poot-conformance                                  # start the bundled reference server
    poot-conformance --base-url http://host:8000      # a server that is already running
    poot-conformance --server-cmd "my-server --port {port}" api/sse loop/commit
    poot-conformance compare ours.json theirs.json      # clauses x servers, as Markdown
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap

from .clauses import PROFILES, SUITE_DIR, load_spec


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="poot-conformance",
        description="Checks an OpenAI-compatible continuous-batching server against the poot spec, "
                    "clause by clause. With neither --base-url nor --server-cmd it starts the bundled "
                    "reference server.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Exit status: 0 when no selected clause failed (result success or partial), 1 when one "
               "failed, crashed or was not run (the server never started, or stopped serving and could not be "
               "started again), 4 on a usage or traceability error.")
    p.add_argument("clauses", nargs="*", metavar="CLAUSE", help="clause id prefixes to run, e.g. api/sse loop/commit/stop/2")
    target = p.add_argument_group("target")
    target.add_argument("--base-url", help="URL of a running server (clauses that restart a server are then not supported)")
    target.add_argument("--server-cmd", help="shell command that starts the server; {port} is replaced by a free port")
    target.add_argument("--model", help="model id to send (default: the first of GET /v1/models)")
    target.add_argument("--recurrent-server-cmd", help="command starting the server with a recurrent-state model")
    target.add_argument("--speculative-server-cmd", help="command starting the server with speculative decoding")
    target.add_argument("--startup-timeout", type=float, default=60.0,
                        help="seconds a starting server may go without being ready (/health 200, or where /health "
                             "answers 404, /v1/models 200) or reporting new progress in a loading 503 (default 60; "
                             "one that keeps reporting progress is waited for up to 15 minutes)")
    target.add_argument("--api-key", help="bearer token sent on every request (default: $OPENAI_API_KEY); never "
                                          "printed or written to a report")
    facts = p.add_argument_group("facts", "what the server does not publish itself (rows, positions, token_budget, "
                                          "block_size, reservation, ...)")
    facts.add_argument("--facts", metavar="FILE", help="a facts file: JSON or YAML mapping fact names to values")
    facts.add_argument("--fact", action="append", default=[], metavar="NAME=VALUE", help="one fact (repeatable)")
    sel = p.add_argument_group("selection")
    sel.add_argument("--profile", action="append", default=[],
                     help=f"profiles to run, repeatable or comma-separated (default all): {', '.join(PROFILES)}")
    sel.add_argument("--strict", action="store_true", help="also run SHOULD clauses")
    sel.add_argument("--list", action="store_true", help="list the selected clauses and exit")
    tune = p.add_argument_group("tuning")
    tune.add_argument("--metrics-dialect", default="auto", choices=("auto", "poot", "vllm", "llamacpp"),
                      help="metric names the server uses (default auto: from the kind of server detected)")
    tune.add_argument("--step-slack", type=int, default=4,
                      help="engine steps allowed between a hang-up being noticeable and the release of its "
                           "request (default 4: the step in flight and the next, plus two for the polls that see it)")
    tune.add_argument("--examples", type=int, default=25, help="examples per property test (default 25)")
    out = p.add_argument_group("reports")
    out.add_argument("--json", metavar="PATH", help="write a JSON report")
    out.add_argument("--junit", metavar="PATH", help="write a JUnit XML report")
    out.add_argument("--markdown", metavar="PATH", help="write a Markdown matrix")
    out.add_argument("--expectations", metavar="FILE",
                     help="expected outcome per clause: exit 0 when every result matches, 1 on any difference")
    out.add_argument("--write-expectations", metavar="FILE", help="write this run's results as an expectations file")
    out.add_argument("-v", "--verbose", action="store_true", help="show pytest progress and tracebacks")
    out.add_argument("--pytest-arg", action="append", default=[], metavar="ARG", help="pass ARG on to pytest")
    return p


def list_clauses(args: argparse.Namespace) -> int:
    spec = load_spec()
    profiles = [x for v in args.profile for x in v.split(",") if x]
    chosen = spec.select(args.clauses, profiles, args.strict)
    for clause in chosen:
        needs = f" [needs {', '.join(clause.needs)}]" if clause.needs else ""
        print(f"{clause.id}  {clause.level} ({clause.profile}){needs}  {clause.title}")
        print(textwrap.indent(textwrap.fill(clause.requirement, 96), "    "))
    print(f"\n{len(chosen)} clauses")
    return 0


def pytest_args(args: argparse.Namespace) -> list[str]:
    out = [str(SUITE_DIR), "-c", str(SUITE_DIR / "pytest.ini"), "--rootdir", str(SUITE_DIR), "--poot-report"]
    out += ["-v", "--tb=short", "-rfE"] if args.verbose else ["-q", "--tb=no", "-rN", "--no-header"]
    options = {"--poot-base-url": args.base_url, "--poot-server-cmd": args.server_cmd, "--poot-model": args.model,
               "--poot-recurrent-server-cmd": args.recurrent_server_cmd,
               "--poot-speculative-server-cmd": args.speculative_server_cmd,
               "--poot-json": args.json, "--poot-junit": args.junit, "--poot-markdown": args.markdown,
               "--poot-metrics-dialect": args.metrics_dialect, "--poot-step-slack": args.step_slack,
               "--poot-examples": args.examples, "--poot-startup-timeout": args.startup_timeout,
               "--poot-facts": args.facts, "--poot-expectations": args.expectations,
               "--poot-write-expectations": args.write_expectations}
    for flag, value in options.items():
        if value is not None:
            out += [flag, str(value)]
    for prefix in args.clauses:
        out += ["--poot-clause", prefix]
    for profile in args.profile:
        out += ["--poot-profile", profile]
    for fact in args.fact:
        out += ["--poot-fact", fact]
    if args.strict:
        out.append("--poot-strict")
    return out + args.pytest_arg


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["compare"]:
        from .compare import main as compare

        return compare(argv[1:])
    args = build_parser().parse_args(argv)
    spec = load_spec()
    profiles = [x for v in args.profile for x in v.split(",") if x]
    if unknown := [x for x in profiles if x not in PROFILES]:
        print(f"poot-conformance: unknown profile(s) {unknown}; known: {', '.join(PROFILES)}", file=sys.stderr)
        return 4
    if args.list:
        return list_clauses(args)
    if not spec.select(args.clauses, profiles, args.strict):
        print("poot-conformance: no clause matches the selection (SHOULD clauses need --strict)", file=sys.stderr)
        return 4
    if not args.base_url and not args.server_cmd:
        from poot.extras import missing

        if lacking := missing("serve"):
            print(f"poot-conformance: the bundled reference server needs the serve extra ({', '.join(lacking)} "
                  "missing): pip install 'poot[serve]', or test your own server with --base-url or --server-cmd",
                  file=sys.stderr)
            return 4
    if args.api_key:  # handed to the suite's clients through the environment, never through argv
        os.environ["OPENAI_API_KEY"] = args.api_key
    import pytest

    code = int(pytest.main(pytest_args(args)))
    # pytest: 0 ok, 1 tests failed, 2 interrupted, 3 internal error, 4 usage, 5 nothing ran.
    return 0 if code == 5 else code


if __name__ == "__main__":
    sys.exit(main())
