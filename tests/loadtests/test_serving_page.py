"""`poot-load serving --page`: the serving results page is written from committed runs'
serving.json, never typed. The checks here run over a fixture, a short real run against the
synthetic model (`fixtures/serving-report/`) and the page the command wrote from it
(`fixtures/serving-page.md`); tests/test_results_pages.py holds docs/results/serving.md to the
committed runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from poot.loadtests import machine
from poot.loadtests.serving import main
from poot.loadtests.serving_report import page

FIXTURES = Path(__file__).resolve().parent / "fixtures"
RUNS = FIXTURES / "serving-report"
PAGE = FIXTURES / "serving-page.md"


def test_the_committed_page_is_what_the_command_writes():
    assert PAGE.read_text() == page(RUNS), (
        "tests/loadtests/fixtures/serving-page.md differs from what its runs give: rewrite it with "
        "`poot-load serving --page tests/loadtests/fixtures/serving-page.md --reports-dir tests/loadtests/fixtures/serving-report`")


def copied(tmp_path: Path) -> Path:
    folder = tmp_path / "serving-report"
    shutil.copytree(RUNS, folder)
    return folder


def test_a_changed_run_changes_the_page(tmp_path):
    folder = copied(tmp_path)
    path = next(folder.glob("*/serving.json"))
    result = json.loads(path.read_text())
    result["servers"][0]["levels"][0]["out_tok_s"] = 12345.6
    path.write_text(json.dumps(result))
    text = page(folder)
    assert text != PAGE.read_text() and "| 12345.6 |" in text


def test_each_run_names_its_date_commit_cpu_and_servers(tmp_path):
    folder = copied(tmp_path)
    path = next(folder.glob("*/serving.json"))
    result = json.loads(path.read_text())
    result.update(started="2026-12-05 10:00:00", commit="0123456789ab",
                  cpu={"model": "AMD EPYC 9R14", "cpus": 2, "flags": ["avx2", "avx512_vnni"]})
    result["servers"][0].update(command="/opt/llama/bin/llama-server -m /data/m.gguf -t 2", info={"build_info": "b6000"})
    (folder / "second").mkdir()
    (folder / "second" / "serving.json").write_text(json.dumps(result))
    text = page(folder)
    assert "Run 2026-12-05 10:00:00; poot commit 0123456789ab; CPU AMD EPYC 9R14 (2 CPUs; avx2, avx512_vnni)." in text
    assert "| poot | b6000 | `llama-server -m m.gguf -t 2` |" in text
    for key in ("commit", "cpu"):
        del result[key]
    (folder / "second" / "serving.json").write_text(json.dumps(result))
    assert "poot commit -; CPU - (" in page(folder)


def test_the_page_option_writes_the_page(tmp_path):
    out = tmp_path / "serving.md"
    assert main(["--page", str(out), "--reports-dir", str(RUNS)]) == 0
    assert out.read_text() == PAGE.read_text()


def test_the_cpu_is_read_from_cpuinfo():
    got = machine.cpu("processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu avx2 fma avx512f avx512_vnni\n")
    assert got["model"] == "AMD EPYC 9R14" and got["flags"] == ["avx2", "fma", "avx512f", "avx512_vnni"]
