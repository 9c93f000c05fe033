"""Logits against the independent float64 reference (reference_llama.py).

- the reference itself: causal, and correct enough to answer a factual prompt on SmolLM2;
- the engine's forward (CpuDriver running engine/models/llama.py's program) against the reference;
- with transformers installed: its own GGUF loader's weights, tokens and logits against ours.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from poot.engine.models import default_model_path, synthetic_llama

from .reference_llama import ReferenceLlama

PROMPT = "The capital of France is"


def engine_last_logits(model, tokens: list[int]) -> np.ndarray:
    """Last-position logits from the engine's numpy driver: one row, one prefill chunk."""
    from poot.engine.drivers.base import RowWork, StepPlan
    from poot.engine.drivers.cpu import CpuDriver
    from poot.engine.plan import fit_plan

    driver = CpuDriver(memory_bytes=1 << 30, compact=False)  # the float32 weights, as loaded
    plan = fit_plan(driver.device(), model.config, 0, model.name)
    driver.prepare(plan, model)
    table = list(range(plan.blocks_for(len(tokens))))
    driver.step(StepPlan.opening({0: table}))
    out = driver.step(StepPlan([RowWork(0, np.array(tokens, np.int32), 0, table, 1)]))
    return np.asarray(out.logits[0], dtype=np.float64)


def test_reference_is_causal():
    model = synthetic_llama(1)
    ref = ReferenceLlama(model.config, model.weights)
    tokens = [5, 17, 200, 3, 99, 42]
    full = ref.logits(tokens)
    assert full.shape == (len(tokens), model.config.vocab_size)
    for n in range(1, len(tokens)):
        np.testing.assert_allclose(ref.logits(tokens[:n]), full[:n], atol=1e-12, rtol=0)
        np.testing.assert_allclose(ref.logits(tokens[:n], last_only=True), full[n - 1], atol=1e-12, rtol=0)


def test_reference_attention_depends_on_relative_positions_only():
    """With rotary embeddings, q.k depends only on the position difference."""
    model = synthetic_llama(2)
    ref = ReferenceLlama(model.config, model.weights)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 1, model.config.head_dim))
    k = rng.standard_normal((1, 1, model.config.head_dim))

    def score(pq, pk):
        return float(np.sum(ref.rope(q, np.array([pq])) * ref.rope(k, np.array([pk]))))

    assert score(7, 3) == pytest.approx(score(104, 100), abs=1e-9)
    assert score(7, 3) != pytest.approx(score(8, 3), abs=1e-6)


def test_engine_forward_matches_reference_on_synthetic():
    model = synthetic_llama(4)
    tokens = list(range(40, 80, 3))
    ref = ReferenceLlama(model.config, model.weights).logits(tokens, last_only=True)
    np.testing.assert_allclose(engine_last_logits(model, tokens), ref, atol=1e-4, rtol=0)


# ---- SmolLM2 -----------------------------------------------------------------------------

@pytest.fixture(scope="session")
def smollm2_reference(smollm2):
    return ReferenceLlama(smollm2.config, smollm2.weights)


@pytest.fixture(scope="session")
def smollm2_prompt_logits(smollm2, smollm2_reference):
    tokens = smollm2.encode_prompt(PROMPT)
    return tokens, smollm2_reference.logits(tokens, last_only=True)


@pytest.mark.realmodel
@pytest.mark.slow
def test_reference_on_smollm2_knows_the_capital_of_france(smollm2, smollm2_prompt_logits):
    """Wrong Q/K un-permutation, orientation or tokenization would not produce this."""
    _, logits = smollm2_prompt_logits
    assert smollm2.tokenizer.decode([int(np.argmax(logits))]) == " Paris"


@pytest.mark.realmodel
@pytest.mark.slow
def test_engine_forward_matches_reference_on_smollm2(smollm2, smollm2_prompt_logits):
    tokens, ref = smollm2_prompt_logits
    got = engine_last_logits(smollm2, tokens)
    assert np.abs(got - ref).max() <= 1e-3, np.abs(got - ref).max()


def _transformers_missing() -> str | None:
    for name in ("torch", "transformers"):
        if importlib.util.find_spec(name) is None:
            return (f"{name} is not installed; for this check: pip install torch transformers "
                    "(the CPU wheel of torch is enough)")
    return None


@pytest.fixture(scope="session")
def hf_smollm2():
    reason = _transformers_missing()
    if reason:
        pytest.skip(reason)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model.eval(), tokenizer


HF_NAMES = {
    "attn_norm": "input_layernorm", "wq": "self_attn.q_proj", "wk": "self_attn.k_proj",
    "wv": "self_attn.v_proj", "wo": "self_attn.o_proj", "mlp_norm": "post_attention_layernorm",
    "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj",
}


@pytest.mark.reference
@pytest.mark.realmodel
@pytest.mark.slow
def test_weights_equal_transformers_gguf_loader(smollm2, hf_smollm2):
    hf, _ = hf_smollm2
    state = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    np.testing.assert_array_equal(smollm2.weights["embed"], state["model.embed_tokens.weight"])
    np.testing.assert_array_equal(smollm2.weights["norm"], state["model.norm.weight"])
    for i in range(smollm2.config.num_layers):
        for canon, name in HF_NAMES.items():
            # both dequantize with gguf-py; transformers un-permutes Q/K with its own code
            np.testing.assert_array_equal(smollm2.weights[f"layers.{i}.{canon}"], state[f"model.layers.{i}.{name}.weight"],
                                          err_msg=f"layer {i} {canon}")


@pytest.mark.reference
@pytest.mark.realmodel
@pytest.mark.slow
@pytest.mark.parametrize("text", [PROMPT, "123 + 4567 = ?", "héllo wörld 😀", "<|im_start|>user\nHi<|im_end|>\n"])
def test_tokens_equal_transformers_gguf_tokenizer(smollm2, hf_smollm2, text):
    _, hf_tok = hf_smollm2
    assert smollm2.tokenizer.encode(text) == hf_tok.encode(text, add_special_tokens=False)


@pytest.mark.reference
@pytest.mark.realmodel
@pytest.mark.slow
def test_logits_equal_transformers(smollm2, hf_smollm2, smollm2_prompt_logits):
    import torch

    hf, _ = hf_smollm2
    tokens, ref = smollm2_prompt_logits
    with torch.no_grad():
        out = hf(torch.tensor([tokens])).logits[0, -1].double().numpy()
    assert np.abs(out - ref).max() <= 1e-3, np.abs(out - ref).max()
