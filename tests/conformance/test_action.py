"""The GitHub Action at the repository's root (action.yml), run as the runner runs a composite
action: its inputs (given, else their defaults) put into each step's `env`, each `run:` step
run by `bash --noprofile --norc -eo pipefail` with GITHUB_ACTION_PATH, GITHUB_OUTPUT,
GITHUB_STEP_SUMMARY and RUNNER_TEMP set, a step after a failure run only under `if: always()`,
and the action's outputs read from its steps' outputs."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
ACTION = ROOT / "action.yml"
EXPRESSION = re.compile(r"\$\{\{\s*([^}]*?)\s*\}\}")


@dataclass
class ActionRun:
    status: int  # the first failed step's exit status, else 0
    outputs: dict[str, str]
    summary: str
    logs: list[str] = field(default_factory=list)


def step_outputs(path: Path) -> dict[str, str]:
    """GITHUB_OUTPUT's lines: NAME=VALUE, or NAME<<DELIMITER ... DELIMITER."""
    out, lines = {}, path.read_text().splitlines() if path.exists() else []
    it = iter(lines)
    for line in it:
        if "<<" in line and ("=" not in line or line.index("<<") < line.index("=")):
            name, delimiter = line.split("<<", 1)
            body = []
            for more in it:
                if more == delimiter:
                    break
                body.append(more)
            out[name] = "\n".join(body)
        elif "=" in line:
            name, value = line.split("=", 1)
            out[name] = value
    return out


def run_action(inputs: dict[str, str], runner_temp: Path, workspace: Path, timeout: float = 900) -> ActionRun:
    action = yaml.safe_load(ACTION.read_text())
    assert action["runs"]["using"] == "composite"
    unknown = set(inputs) - set(action["inputs"])
    assert not unknown, f"not inputs of the action: {unknown}"
    values = {name: inputs.get(name, str(spec.get("default", ""))) for name, spec in action["inputs"].items()}
    steps: dict[str, dict[str, str]] = {}

    def resolve(text: str) -> str:
        def one(m: re.Match) -> str:
            expr = m.group(1)
            if expr.startswith("inputs."):
                return values[expr.removeprefix("inputs.")]
            if expr.startswith("steps."):
                sid, _, name = expr.removeprefix("steps.").split(".", 2)
                return steps.get(sid, {}).get(name, "")
            raise AssertionError(f"an expression the test runner does not know: {expr}")
        return EXPRESSION.sub(one, str(text))

    summary = runner_temp / "step-summary.md"
    run = ActionRun(0, {}, "")
    for i, step in enumerate(action["runs"]["steps"]):
        condition = step.get("if", "success()")
        if run.status and condition != "always()":
            continue
        assert "run" in step and step.get("shell") == "bash", f"step {i} is not a bash run step"
        assert "${{" not in step["run"], f"step {i} pastes an expression into its script; pass it through env"
        output = runner_temp / f"output-{i}"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "POOT_", "GITHUB_"))}
        env |= {"GITHUB_ACTION_PATH": str(ROOT), "GITHUB_OUTPUT": str(output), "GITHUB_STEP_SUMMARY": str(summary),
                "RUNNER_TEMP": str(runner_temp), "GITHUB_WORKSPACE": str(workspace), "CI": "true"}
        env |= {k: resolve(v) for k, v in (step.get("env") or {}).items()}
        script = runner_temp / f"step-{i}.sh"
        script.write_text(step["run"])
        r = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", str(script)], cwd=workspace, env=env,
                           capture_output=True, text=True, timeout=timeout)
        run.logs.append(f"--- {step.get('name')} (exit {r.returncode})\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
        if "id" in step:
            steps[step["id"]] = step_outputs(output)
        if r.returncode and not run.status:
            run.status = r.returncode
    run.outputs = {name: resolve(spec["value"]) for name, spec in action["outputs"].items()}
    run.summary = summary.read_text() if summary.exists() else ""
    return run


def test_the_action_reads_its_inputs_from_the_environment_only():
    """No `${{ }}` inside a script (a server command or key with a quote in it cannot break out),
    and every input the steps name exists."""
    action = yaml.safe_load(ACTION.read_text())
    named = set()
    for step in action["runs"]["steps"]:
        assert "${{" not in step["run"]
        for value in (step.get("env") or {}).values():
            named |= {m.removeprefix("inputs.") for m in EXPRESSION.findall(str(value)) if m.startswith("inputs.")}
    assert named <= set(action["inputs"]) and {"server-cmd", "base-url", "expectations", "strict", "profiles",
                                                 "api-key"} <= set(action["inputs"])
    assert {"json", "junit", "markdown"} <= set(action["outputs"])


@pytest.mark.slow
def test_the_action_gates_the_reference_server_and_names_its_reports(tmp_path):
    """Installs the suite from the action's checkout into a fresh virtual environment (no
    `pip install poot` from the index), runs it on the reference server, and hands back the
    reports; then, on a server whose /health fails, fails the step and still names them."""
    runner_temp, workspace = tmp_path / "runner", tmp_path / "work"
    runner_temp.mkdir()
    workspace.mkdir()
    serve = Path(sys.executable).parent / "poot-serve"
    command = f"{shlex.quote(str(serve))} --model synthetic --port {{port}}"
    run = run_action({"server-cmd": command, "clauses": "api/health api/models api/completions", "strict": "true",
                      "report-dir": "reports"}, runner_temp, workspace)
    assert run.status == 0, "\n".join(run.logs)
    assert run.outputs == {"json": "reports/report.json", "junit": "reports/junit.xml",
                           "markdown": "reports/report.md", "result": "success"}
    report = json.loads((workspace / run.outputs["json"]).read_text())
    assert {c["id"]: c["outcome"] for c in report["clauses"]} == {
        "api/health/1": "passed", "api/models/1": "passed", "api/completions/1": "passed"}
    assert (workspace / run.outputs["junit"]).exists()
    assert "# Conformance: success" in run.summary
    suite = runner_temp / "poot-conformance-venv" / "bin" / "python"
    probe = subprocess.run([str(suite), "-c", "import numpy"], capture_output=True)
    assert probe.returncode != 0  # the suite alone: the engine's libraries are not installed

    server = ThreadingHTTPServer(("127.0.0.1", 0), Failing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        failed = run_action({"base-url": f"http://127.0.0.1:{server.server_address[1]}", "clauses": "api/health",
                             "api-key": "k-secret-123456"}, runner_temp, workspace)
    finally:
        server.shutdown()
    assert failed.status == 1, "\n".join(failed.logs)
    assert failed.outputs["result"] == "failure" and failed.outputs["json"] == "conformance-report/report.json"
    text = (workspace / failed.outputs["json"]).read_text()
    assert "k-secret-123456" not in text and "k-secret-123456" not in "\n".join(failed.logs)
    assert "# Conformance: failure" in failed.summary  # the summary step ran after the failure


class Failing(BaseHTTPRequestHandler):
    """/health answers 500; /v1/models serves."""

    def do_GET(self):  # noqa: N802 - http.server's naming
        status, body = (500, {"status": "broken"}) if self.path == "/health" else (
            200, {"object": "list", "data": [{"id": "stub"}]})
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass
