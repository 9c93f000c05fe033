#!/usr/bin/env bash
# Rewrites the results pages under docs/results/ from the reports committed in this repository:
# docs/results/conformance.md from conformance-report/<server>/report.json, with each departure's
# reason from ci/expectations/<server>.yaml. tests/test_results_pages.py fails while a page
# differs from what this writes.
set -euo pipefail
cd "$(dirname "$0")/.."
exe=.venv/bin/poot-conformance
[ -x "$exe" ] || exe=poot-conformance
"$exe" compare --page docs/results/conformance.md --reports-dir conformance-report --expectations-dir ci/expectations
# docs/results/serving.md from serving-report/<run>/serving.json (poot-load serving --out DIR), once runs are committed
if [ -d serving-report ]; then
    load=.venv/bin/poot-load
    [ -x "$load" ] || load=poot-load
    "$load" serving --page docs/results/serving.md --reports-dir serving-report
fi
