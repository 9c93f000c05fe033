"""Writers for tiny model files built from the synthetic model's weights.

The GGUF writer mimics llama.cpp's HF->GGUF converter: it permutes the Q and K rows the way
the converter does, so reading a file back tests the loader's un-permutation.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import gguf
import numpy as np

from poot.engine.models.synthetic import synthetic_llama

Q = gguf.GGMLQuantizationType

# The chat template SmolLM2-135M-Instruct ships (copied from its GGUF metadata).
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def converter_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute, verbatim in effect."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def byte_vocab() -> tuple[list[str], list[int]]:
    """A GPT-2 style vocab whose token i < 256 is byte i (like ByteTokenizer), then <s>, </s>."""
    table = bytes_to_unicode()
    tokens = [table[b] for b in range(256)] + ["<s>", "</s>"]
    types = [int(gguf.TokenType.NORMAL)] * 256 + [int(gguf.TokenType.CONTROL)] * 2
    return tokens, types


def _quantize(w: np.ndarray, qtype) -> tuple[np.ndarray, object]:
    if qtype == Q.F32:
        return w.astype(np.float32), None
    if qtype == Q.F16:
        return w.astype(np.float16), None
    return gguf.quants.quantize(w.astype(np.float32), qtype), qtype


GGUF_NAMES = {
    "attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output",
    "mlp_norm": "ffn_norm", "w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down",
}


def write_gguf(path: Path, *, seed: int = 0, qtype=Q.F32, tied: bool = False, arch: str = "llama",
               skip_tensors: tuple[str, ...] = (), skip_keys: tuple[str, ...] = (),
               extra_tensors: dict | None = None, tokenizer: dict | None = None, permute: bool = True):
    """Writes the synthetic model as a GGUF file; returns the synthetic LoadedModel it came from.

    Norms stay F32 (as llama.cpp keeps 1-D tensors); matrices use `qtype`.
    `tokenizer` overrides tokenizer.ggml.* keys (without the prefix).
    """
    model = synthetic_llama(seed)
    cfg, w = model.config, model.weights
    writer = gguf.GGUFWriter(str(path), arch)
    keys = {
        "context_length": (writer.add_uint32, cfg.max_positions),
        "embedding_length": (writer.add_uint32, cfg.hidden_size),
        "block_count": (writer.add_uint32, cfg.num_layers),
        "feed_forward_length": (writer.add_uint32, cfg.intermediate_size),
        "attention.head_count": (writer.add_uint32, cfg.num_heads),
        "attention.head_count_kv": (writer.add_uint32, cfg.num_kv_heads),
        "rope.dimension_count": (writer.add_uint32, cfg.head_dim),
        "rope.freq_base": (writer.add_float32, 50000.0),
        "attention.layer_norm_rms_epsilon": (writer.add_float32, 1e-6),
        "vocab_size": (writer.add_uint32, cfg.vocab_size),
    }
    writer.add_name("tiny-test")
    for key, (add, value) in keys.items():
        if key not in skip_keys:
            add(f"{arch}.{key}", value)
    tokens, types = byte_vocab()
    tok = {"model": "gpt2", "pre": "default", "tokens": tokens, "token_type": types, "merges": [],
           "bos_token_id": 256, "eos_token_id": 257, "add_bos_token": True,
           "chat_template": SMOLLM2_TEMPLATE} | (tokenizer or {})
    for key, value in tok.items():
        full = "tokenizer.chat_template" if key == "chat_template" else f"tokenizer.ggml.{key}"
        if value is None or (isinstance(value, list) and not value):
            continue
        if isinstance(value, bool):
            writer.add_bool(full, value)
        elif isinstance(value, int):
            writer.add_uint32(full, value)
        elif isinstance(value, str):
            writer.add_string(full, value)
        elif key == "token_type":
            writer.add_array(full, [int(v) for v in value])
        else:
            writer.add_array(full, value)

    def add(name: str, arr: np.ndarray, matrix: bool):
        if name in skip_tensors:
            return
        if matrix:
            data, raw = _quantize(arr, qtype)
            writer.add_tensor(name, data, raw_dtype=raw)
        else:
            writer.add_tensor(name, arr.astype(np.float32))

    add("token_embd.weight", w["embed"], True)
    for i in range(cfg.num_layers):
        for canon, short in GGUF_NAMES.items():
            arr = w[f"layers.{i}.{canon}"]
            if permute and canon == "wq":
                arr = converter_permute(arr, cfg.num_heads)
            if permute and canon == "wk":
                arr = converter_permute(arr, cfg.num_kv_heads)
            add(f"blk.{i}.{short}.weight", arr, arr.ndim == 2)
    add("output_norm.weight", w["norm"], False)
    if not tied:
        add("output.weight", w["lm_head"], True)
    for name, (arr, raw) in (extra_tensors or {}).items():
        writer.add_tensor(name, arr, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


# ---- Hugging Face folders -------------------------------------------------------------

HF_NAMES = {
    "attn_norm": "input_layernorm", "wq": "self_attn.q_proj", "wk": "self_attn.k_proj",
    "wv": "self_attn.v_proj", "wo": "self_attn.o_proj", "mlp_norm": "post_attention_layernorm",
    "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj",
}


def hf_state_dict(weights: dict[str, np.ndarray], num_layers: int, tied: bool) -> dict[str, np.ndarray]:
    out = {"model.embed_tokens.weight": weights["embed"], "model.norm.weight": weights["norm"]}
    for i in range(num_layers):
        for canon, hf in HF_NAMES.items():
            out[f"model.layers.{i}.{hf}.weight"] = weights[f"layers.{i}.{canon}"]
    if not tied:
        out["lm_head.weight"] = weights["lm_head"]
    return out


def to_bf16_bytes(a: np.ndarray) -> bytes:
    """float32 -> bfloat16 bytes, round to nearest even."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16).tobytes()


def bf16_round(a: np.ndarray) -> np.ndarray:
    raw = np.frombuffer(to_bf16_bytes(a), dtype=np.uint16)
    return (raw.astype(np.uint32) << 16).view(np.float32).reshape(a.shape)


def write_safetensors_raw(path: Path, tensors: dict[str, np.ndarray], dtype: str) -> None:
    """Writes a safetensors file by hand (the numpy API cannot write BF16)."""
    header, blobs, offset = {}, [], 0
    for name, arr in tensors.items():
        if dtype == "BF16":
            blob = to_bf16_bytes(arr)
        elif dtype == "F16":
            blob = np.ascontiguousarray(arr, dtype=np.float16).tobytes()
        else:
            blob = np.ascontiguousarray(arr, dtype=np.float32).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for blob in blobs:
            f.write(blob)


def byte_level_tokenizer_json(post_bos: bool) -> str:
    """A tokenizers.Tokenizer: byte-level BPE over the byte_vocab, <s>/</s> special."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    tokens, _ = byte_vocab()
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<s>", special=True, normalized=False),
                            AddedToken("</s>", special=True, normalized=False)])
    if post_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", 256)])
    return tok.to_str()


def write_hf_folder(folder: Path, *, seed: int = 0, dtype: str = "F32", tied: bool = False,
                    shards: int = 1, config_overrides: dict | None = None, post_bos: bool = True,
                    tokenizer_config: dict | None = None):
    """Writes the synthetic model as a Hugging Face Llama checkpoint folder."""
    model = synthetic_llama(seed)
    cfg = model.config
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "max_position_embeddings": cfg.max_positions,
        "rope_theta": 50000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": tied, "hidden_act": "silu",
        "rope_scaling": None, "bos_token_id": 256, "eos_token_id": 257, "torch_dtype": "float32",
    } | (config_overrides or {})
    (folder / "config.json").write_text(json.dumps(config))
    state = hf_state_dict(model.weights, cfg.num_layers, tied)
    names = list(state)
    if shards == 1:
        write_safetensors_raw(folder / "model.safetensors", state, dtype)
    else:
        weight_map = {}
        for s in range(shards):
            part = names[s::shards]
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            write_safetensors_raw(folder / fname, {n: state[n] for n in part}, dtype)
            weight_map |= {n: fname for n in part}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "tokenizer.json").write_text(byte_level_tokenizer_json(post_bos))
    tc = {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True},
          "chat_template": SMOLLM2_TEMPLATE} | (tokenizer_config or {})
    (folder / "tokenizer_config.json").write_text(json.dumps(tc))
    return model
