#!/usr/bin/env bash
# Gates a server on the poot conformance suite.
#   ci/conformance.sh --url http://127.0.0.1:8000 [poot-conformance options...]
#   ci/conformance.sh --cmd "my-server --port {port}" [poot-conformance options...]
#   ci/conformance.sh                                  (the bundled reference server)
#   ci/conformance.sh --cmd "..." --expectations expected.yaml   (gate on "no change" instead)
# Writes reports to ${POOT_REPORT_DIR:-conformance-report}/ and exits non-zero on any failed clause,
# or, with --expectations FILE (or $POOT_EXPECTATIONS), on any result that differs from the file.
# The API key, if the server needs one, comes from $OPENAI_API_KEY (or --api-key).
set -euo pipefail
out="${POOT_REPORT_DIR:-conformance-report}"
target=()
case "${1:-}" in
  --url) target=(--base-url "$2"); shift 2 ;;
  --cmd) target=(--server-cmd "$2"); shift 2 ;;
esac
if [ -n "${POOT_EXPECTATIONS:-}" ]; then
  target+=(--expectations "$POOT_EXPECTATIONS")
fi
mkdir -p "$out"
poot-conformance "${target[@]}" --json "$out/report.json" --junit "$out/junit.xml" \
  --markdown "$out/report.md" "$@"
