"""The docs against a running reference server on the synthetic model: every command the
README shows is run here (or, for the set-up and test commands, found in CI's script), and
server/README.md's metrics table is what /metrics exports, name for name and type for type."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .server.proc import Server

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BIN = Path(sys.executable).parent
README_PORT = "8000"  # the port the README's commands name; each is run on the test server's


def blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README.read_text(), re.M | re.S)


def commands() -> list[str]:
    """Every shell command of the README's sh blocks, continuation lines joined, comments dropped."""
    out = []
    for block in blocks("sh"):
        for command in block.replace("\\\n", " ").splitlines():
            if command.strip() and not command.lstrip().startswith("#"):
                out.append(" ".join(command.split()))
    return out


def served_args() -> list[str]:
    """The options the README starts poot-serve with."""
    [serve] = [c for c in commands() if c.startswith(".venv/bin/poot-serve")]
    return shlex.split(serve)[1:]


@pytest.fixture(scope="module")
def server():
    args = served_args()
    port_at = args.index("--port")
    del args[port_at: port_at + 2]  # the server takes a free port; the model is the synthetic one
    s = Server(*args)
    yield s
    s.stop()


def on(port: int, command: str) -> str:
    return command.replace(f":{README_PORT}", f":{port}")


def run(command: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    words = shlex.split(command)
    if (BIN / words[0]).exists():  # the venv's own entry points, as .venv/bin/ has them
        words[0] = str(BIN / words[0])
    return subprocess.run(words, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_every_readme_command_is_run_somewhere(server, tmp_path):
    """Set-up and test commands: CI's script runs them (`.ci/run`). The rest run here, against the
    test server: curl as it stands, poot-conformance on one clause (the command's own options kept),
    poot-load as it stands."""
    ci = (ROOT / ".ci" / "run").read_text()
    ran = []
    for command in commands():
        if command.startswith("python3 -m venv") or command.startswith(".venv/bin/python -m pytest"):
            for part in command.split(" && "):
                words = part.replace(".venv/bin/pip install", ".venv/bin/python -m pip install").split()
                if words[0] == ".venv/bin/poot-conformance":  # the bundled run: tests/conformance/test_reference_passes.py
                    assert (ROOT / "tests" / "conformance" / "test_reference_passes.py").exists()
                    continue
                line = next((ln for ln in ci.splitlines() if ln.startswith(" ".join(words[:3]))
                             and all(w.strip("'") in ln.replace("'", "") for w in words)), None)
                assert line, f"README.md's set-up command `{part}` is not what .ci/run runs"
            ran.append(command)
        elif command.startswith(".venv/bin/poot-serve"):
            ran.append(command)  # the module's server was started with its options
        elif command.startswith("curl"):
            done = subprocess.run(on(server.port, command), shell=True, capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr
            answer = json.loads(done.stdout)
            assert "choices" in answer, f"{command}\nanswered {answer}"
            assert answer["choices"][0]["finish_reason"] in ("stop", "length"), answer
            ran.append(command)
        elif command.startswith("poot-conformance"):
            done = run(on(server.port, command) + " api/models", tmp_path)
            assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            for option in ("--json", "--junit", "--write-expectations"):
                if option in command:
                    assert (tmp_path / shlex.split(command)[shlex.split(command).index(option) + 1]).exists()
            ran.append(command)
        elif command.startswith("poot-load"):
            done = run(on(server.port, command), tmp_path, timeout=300)
            assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            assert list(tmp_path.glob("loadtest-reports/*/summary.json")), "poot-load wrote no report"
            ran.append(command)
        else:
            pytest.fail(f"README.md shows `{command}`, which no test runs: run it here or in CI")
    assert len(ran) >= 6, ran


def test_the_readmes_action_inputs_are_the_actions():
    [snippet] = blocks("yaml")
    [step] = yaml.safe_load(snippet)
    inputs = yaml.safe_load((ROOT / "action.yml").read_text())["inputs"]
    unknown = sorted(set(step["with"]) - set(inputs))
    assert not unknown, f"README.md's action step passes {unknown}, which action.yml does not take"
    workflow = yaml.safe_load((ROOT / "ci" / "conformance.yml").read_text())
    uses = [s["uses"] for job in workflow["jobs"].values() for s in job["steps"] if "uses" in s]
    assert step["uses"] in uses, "README.md's action step and ci/conformance.yml name the action differently"


def metrics_table() -> dict[str, str]:
    text = (ROOT / "server" / "README.md").read_text()
    section = text[text.index("## Metrics"):]
    section = section[: section.index("\n## ", 1)]
    rows = re.findall(r"^\| `([^`]+)` \| ([\w, ]+) \|", section, re.M)
    return {re.sub(r"\{.*\}", "", name): kind.strip() for name, kind in rows}


def test_the_metrics_table_is_what_the_server_exports(server):
    server.complete(prompt="hello", max_tokens=2)  # every family has seen a request
    text = server.client.get("/metrics").text
    exported = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    table = metrics_table()
    assert table.pop("process_*") == "gauge, counter"
    assert any(name.startswith("process_") for name in exported), "no process_* metric exported"
    exported = {n: k for n, k in exported.items() if not n.startswith("process_")}
    missing = sorted(set(exported) - set(table))
    extra = sorted(set(table) - set(exported))
    wrong = sorted(f"{n}: table {table[n]}, exported {exported[n]}" for n in set(table) & set(exported)
                   if table[n] != exported[n])
    assert not (missing or extra or wrong), (
        f"server/README.md's metrics table and /metrics part: not in the table {missing}; not exported {extra}; "
        f"types {wrong}")
