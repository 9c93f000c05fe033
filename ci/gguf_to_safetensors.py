"""Writes a GGUF checkpoint out as a Hugging Face folder (config, tokenizer, safetensors), so a
server that cannot read GGUF computes with the same weights as poot-serve and llama-server.

    python ci/gguf_to_safetensors.py MODEL.gguf OUT_DIR

Run with an interpreter that has torch, transformers, gguf, accelerate and safetensors (the vLLM
venv of ci/setup_vllm.sh). transformers' own GGUF loader dequantizes the weights to float32; the
model it returns is marked GGUF-quantized and refuses save_pretrained, so the state dict and the
config are written by hand.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def convert(gguf: Path, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    config["torch_dtype"] = "float32"
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)  # safetensors stores no shared tensors; the config ties it
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.to_json_file(out / "generation_config.json")
    tokenizer.save_pretrained(out)
    print(f"{len(tensors)} tensors, {sum(t.numel() for t in tensors.values()):,} weights -> {out}", file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: gguf_to_safetensors.py MODEL.gguf OUT_DIR")
    convert(Path(sys.argv[1]).resolve(), Path(sys.argv[2]))
