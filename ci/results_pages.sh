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
