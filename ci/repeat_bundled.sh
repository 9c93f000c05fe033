#!/usr/bin/env bash
# The suite must never flake on its own reference server: runs the bundled conformance run
# (`poot-conformance --strict`) N times in a row, each with its JSON report kept, beside
# HOGS CPU-bound processes (default 1, on a 2-core machine one core taken), and prints one
# line per run and a summary. Exit 1 if any run failed.
#   ci/repeat_bundled.sh [N] [poot-conformance options...]
#   HOGS=0 ci/repeat_bundled.sh 5
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:-20}"
shift || true
out="${POOT_REPORT_DIR:-conformance-report/repeat}"
mkdir -p "$out"
hogs=()
for _ in $(seq 1 "${HOGS:-1}"); do
  python3 -c 'while True: pass' &
  hogs+=($!)
done
trap '[ ${#hogs[@]} -eq 0 ] || kill "${hogs[@]}" 2>/dev/null' EXIT
failed=0
start=$(date +%s)
for i in $(seq 1 "$runs"); do
  t0=$(date +%s)
  if poot-conformance --strict --json "$out/run-$i.json" "$@" > "$out/run-$i.log" 2>&1; then
    verdict=passed
  else
    verdict=FAILED
    failed=$((failed + 1))
  fi
  echo "run $i/$runs: $verdict in $(( $(date +%s) - t0 )) s: $(tail -n 2 "$out/run-$i.log" | head -n 1)"
done
echo "$((runs - failed)) of $runs runs passed beside ${HOGS:-1} CPU-bound process(es), in $(( $(date +%s) - start )) s; reports in $out"
[ "$failed" -eq 0 ]
