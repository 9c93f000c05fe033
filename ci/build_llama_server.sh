#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` offline, CPU only, from the llama.cpp source vendored in a
# pinned llama-cpp-python sdist on PyPI. The build is cached outside the repository: a second
# run with the binary present prints its path and does nothing else.
#
#   ci/build_llama_server.sh            # prints the path of llama-server when done
#   LLAMA_SERVER_CACHE=/some/dir ci/build_llama_server.sh
#   LLAMA_CPU_ISA=avx2 ci/build_llama_server.sh   # AVX2 and FMA only, as on a CPU without AVX-512
#
# About 12 minutes on 2 cores. Needs cmake and a C++ compiler (Debian: cmake g++).
set -euo pipefail

version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
isa="${LLAMA_CPU_ISA:-native}"
case "$isa" in
  native) suffix="" ;;
  avx2) suffix="-avx2" ;;
  *) echo "build_llama_server: LLAMA_CPU_ISA must be native or avx2, not '$isa'" >&2; exit 2 ;;
esac
cache="${LLAMA_SERVER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/poot/llama-server-$version$suffix}"
sdist_dir="${XDG_CACHE_HOME:-$HOME/.cache}/poot/llama-server-$version"
binary="$cache/build/bin/llama-server"

# No AMX: a VM can advertise it in CPUID without its kernel granting the tile state, and
# ggml's AMX products then crash llama-server at its first step (seen on a 2-core
# VM). GCC's explicit -mno-* flags win over -march=native whatever their order.
cpu_flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# The AVX2 build stands for the CPUs without AVX-512 (AMD before Zen 4, Intel's client chips
# since Alder Lake) on a machine that has it: ggml's own switches, no -march=native.
isa_options=(-DGGML_NATIVE=ON)
if [ "$isa" = avx2 ]; then
  isa_options=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
               -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF)
  cpu_flags="$cpu_flags -mno-avx512f -mno-avxvnni"
fi
stamp="$cache/build/poot-cpu-flags"

if [ -x "$binary" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$cpu_flags" ]; then
  echo "$binary"
  exit 0
fi
for tool in cmake c++ python3; do
  command -v "$tool" >/dev/null || { echo "build_llama_server: $tool is missing (Debian: apt-get install cmake g++)" >&2; exit 2; }
done

mkdir -p "$cache" "$sdist_dir"
sdist="$sdist_dir/llama_cpp_python-$version.tar.gz"
if [ ! -f "$sdist" ]; then
  echo "build_llama_server: downloading the llama-cpp-python $version sdist" >&2
  python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$sdist_dir" >&2
fi
src="$cache/llama_cpp_python-$version/vendor/llama.cpp"
[ -d "$src" ] || tar -xzf "$sdist" -C "$cache"

jobs="$(nproc 2>/dev/null || echo 2)"
echo "build_llama_server: configuring and building llama-server with $jobs jobs" >&2
# Offline and lean: no curl or OpenSSL, no web UI (its prebuilt copy would be downloaded),
# no tests, tools or examples beyond the server itself.
cmake -S "$src" -B "$cache/build" -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_BUILD_HTML=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_APP=OFF \
  "${isa_options[@]}" -DBUILD_SHARED_LIBS=OFF \
  -DCMAKE_C_FLAGS="$cpu_flags" -DCMAKE_CXX_FLAGS="$cpu_flags" >&2
cmake --build "$cache/build" --target llama-server -j "$jobs" >&2
[ -x "$binary" ] || { echo "build_llama_server: the build finished but $binary is missing" >&2; exit 1; }
echo "$cpu_flags" > "$stamp"
echo "$binary"
