#!/usr/bin/env bash
# The rocm backend on a real AMD GPU, in one prepared run: ci/gpu_ptx.sh with BACKEND=rocm
# (the kernels built by hiprtc for the device against their references, the CuPy driver's
# tests, the backend-parametrized engine tests on rocm, SmolLM2 against the NumPy driver,
# `poot-conformance --strict` on `poot-serve --backend rocm`, and the decode-step benchmark;
# JUnit, logs and tables in OUT). The same verbs:
#
#   bash ci/gpu_rocm.sh pack | stage | run OUT
#
# Where no ROCm device exists it stops at once, saying why, with exit code 2.
BACKEND=rocm exec bash "$(dirname "$0")/gpu_ptx.sh" "$@"
