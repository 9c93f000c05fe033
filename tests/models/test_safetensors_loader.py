"""load_safetensors: Hugging Face Llama folders written from the synthetic model."""

from __future__ import annotations

import json

import numpy as np
import pytest

from poot.engine.models import ModelLoadError
from poot.engine.models.safetensors_loader import load_safetensors

from .helpers import SMOLLM2_TEMPLATE, bf16_round, write_hf_folder
from .test_gguf_loader import assert_one_line


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
def test_round_trip(tmp_path, dtype):
    src = write_hf_folder(tmp_path / "m", seed=6, dtype=dtype)
    model = load_safetensors(tmp_path / "m")
    cfg, ref = model.config, src.config
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "max_positions"):
        assert getattr(cfg, field) == getattr(ref, field), field
    assert cfg.rope_theta == 50000.0 and cfg.rms_eps == 1e-6 and cfg.tie_embeddings is False
    assert set(model.weights) == set(src.weights)
    for name, want in src.weights.items():
        got = model.weights[name]
        assert got.dtype == np.float32 and got.flags.c_contiguous and got.flags.writeable, name
        if dtype == "F32":
            np.testing.assert_array_equal(got, want, err_msg=name)
        elif dtype == "F16":
            np.testing.assert_array_equal(got, want.astype(np.float16).astype(np.float32), err_msg=name)
        else:
            np.testing.assert_array_equal(got, bf16_round(want), err_msg=name)
    assert model.source == str(tmp_path / "m") and model.name == "m"


def test_sharded_checkpoint(tmp_path):
    src = write_hf_folder(tmp_path / "m", shards=3)
    model = load_safetensors(tmp_path / "m")
    for name, want in src.weights.items():
        np.testing.assert_array_equal(model.weights[name], want, err_msg=name)


def test_tied_checkpoint(tmp_path):
    write_hf_folder(tmp_path / "m", tied=True)
    model = load_safetensors(tmp_path / "m")
    assert model.config.tie_embeddings is True and "lm_head" not in model.weights


def test_tokenizer_template_and_special_tokens(tmp_path):
    write_hf_folder(tmp_path / "m")
    model = load_safetensors(tmp_path / "m")
    tok = model.tokenizer
    assert tok.encode("héllo") == list("héllo".encode())
    assert tok.bos_token_id == 256 and tok.eos_token_ids == frozenset({257}) and tok.add_bos is True
    assert model.encode_prompt("a") == [256, 97]
    assert model.chat_template == SMOLLM2_TEMPLATE
    assert model.special_tokens["bos_token"] == "<s>" and model.special_tokens["eos_token"] == "</s>"


def test_add_bos_follows_the_post_processor_or_the_config_flag(tmp_path):
    write_hf_folder(tmp_path / "a", post_bos=False)
    assert load_safetensors(tmp_path / "a").tokenizer.add_bos is False
    write_hf_folder(tmp_path / "b", post_bos=False, tokenizer_config={"add_bos_token": True})
    assert load_safetensors(tmp_path / "b").tokenizer.add_bos is True
    write_hf_folder(tmp_path / "c", post_bos=True, tokenizer_config={"add_bos_token": False})
    assert load_safetensors(tmp_path / "c").tokenizer.add_bos is False


def test_generation_config_eos_ids_and_jinja_template_file(tmp_path):
    folder = tmp_path / "m"
    write_hf_folder(folder, tokenizer_config={"chat_template": None})
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, 256]}))
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    model = load_safetensors(folder)
    assert model.tokenizer.eos_token_ids == frozenset({256, 257})
    assert model.chat_template == "{{ messages[0]['content'] }}"


def test_named_templates_pick_default(tmp_path):
    folder = tmp_path / "m"
    write_hf_folder(folder, tokenizer_config={"chat_template": [{"name": "tool_use", "template": "T"},
                                                                {"name": "default", "template": "D"}]})
    assert load_safetensors(folder).chat_template == "D"


# ---- errors ----------------------------------------------------------------------------

def test_unsupported_architecture(tmp_path):
    write_hf_folder(tmp_path / "m", config_overrides={"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    with pytest.raises(ModelLoadError) as err:
        load_safetensors(tmp_path / "m")
    assert_one_line(err, "architecture", "GPT2LMHeadModel")


def test_rope_scaling_refused(tmp_path):
    write_hf_folder(tmp_path / "m", config_overrides={"rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(ModelLoadError) as err:
        load_safetensors(tmp_path / "m")
    assert_one_line(err, "rope", "llama3")


def test_missing_tensor(tmp_path):
    folder = tmp_path / "m"
    write_hf_folder(folder, shards=2)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    # rewrite shard 2 without one tensor
    from safetensors.numpy import load_file, save_file

    shard = folder / "model-00002-of-00002.safetensors"
    tensors = load_file(str(shard))
    victim = next(n for n in tensors if "k_proj" in n)
    del tensors[victim]
    save_file(tensors, str(shard))
    del index["weight_map"][victim]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError) as err:
        load_safetensors(folder)
    assert_one_line(err, "missing", victim)


def test_truncated_file(tmp_path):
    folder = tmp_path / "m"
    write_hf_folder(folder)
    path = folder / "model.safetensors"
    data = path.read_bytes()
    for keep in (4, 100, len(data) // 2, len(data) - 1):
        path.write_bytes(data[:keep])
        with pytest.raises(ModelLoadError) as err:
            load_safetensors(folder)
        assert_one_line(err, "truncated")


def test_corrupt_header(tmp_path):
    folder = tmp_path / "m"
    write_hf_folder(folder)
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:16] = b"\x00garbage"
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError) as err:
        load_safetensors(folder)
    assert_one_line(err, "corrupt")


def test_unsupported_dtype(tmp_path):
    folder = tmp_path / "m"
    write_hf_folder(folder)
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.int32)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError) as err:
        load_safetensors(folder)
    assert_one_line(err, "model.norm.weight", "I32")


def test_missing_pieces(tmp_path):
    folder = tmp_path / "m"
    write_hf_folder(folder)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError) as err:
        load_safetensors(folder)
    assert_one_line(err, "tokenizer.json")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError) as err:
        load_safetensors(folder)
    assert_one_line(err, ".safetensors")
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError) as err:
        load_safetensors(folder)
    assert_one_line(err, "config.json")


def _write_raw(path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)


def test_mapped_tensors_read_the_file_and_keep_writes_to_the_process(tmp_path):
    from safetensors.numpy import save_file

    from poot.engine.models.safetensors_loader import map_tensors

    path = tmp_path / "t.safetensors"
    want = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "c": np.arange(6, dtype=np.uint8)}
    save_file(want, str(path))
    got = map_tensors(path)
    for name, arr in want.items():
        np.testing.assert_array_equal(got[name], arr)
        assert got[name].flags.writeable and got[name].dtype == arr.dtype
    got["w"][0, 0] = 99
    np.testing.assert_array_equal(map_tensors(path)["w"], want["w"])  # the file is unchanged


@pytest.mark.parametrize(("entry", "match"), [
    ({"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}, "has 4 bytes for shape"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}, "has 4 bytes for shape"),
    ({"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}, "BF16, which is not mapped"),
    ({"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, "ends past the end of the file"),
])
def test_a_mapped_tensor_whose_bytes_do_not_fit_is_refused(tmp_path, entry, match):
    from poot.engine.models.safetensors_loader import map_tensors

    path = tmp_path / "bad.safetensors"
    _write_raw(path, {"t": entry}, bytes(8))
    with pytest.raises(ModelLoadError, match=match):
        map_tensors(path)
