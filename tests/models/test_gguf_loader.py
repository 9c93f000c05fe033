"""load_gguf: tiny files written with gguf.GGUFWriter from the synthetic model's weights."""

from __future__ import annotations

import mmap
import os

import gguf
import numpy as np
import pytest

from poot.engine.models import ModelLoadError, gguf_loader
from poot.engine.models.gguf_loader import load_gguf, unpermute_rows

from .helpers import SMOLLM2_TEMPLATE, Q, converter_permute, write_gguf


def assert_one_line(err: pytest.ExceptionInfo, *words: str) -> None:
    msg = str(err.value)
    assert "\n" not in msg and msg.strip() == msg and msg, repr(msg)
    for word in words:
        assert word.lower() in msg.lower(), f"{word!r} not in {msg!r}"


def test_unpermute_inverts_the_converter_permutation():
    rng = np.random.default_rng(0)
    for heads, head_dim in [(4, 16), (3, 8), (1, 4)]:
        w = rng.standard_normal((heads * head_dim, 12)).astype(np.float32)
        np.testing.assert_array_equal(unpermute_rows(converter_permute(w, heads), heads), w)


def test_f32_round_trip_is_exact_and_maps_the_config(tmp_path):
    path = tmp_path / "tiny.gguf"
    src = write_gguf(path, seed=5)
    model = load_gguf(path)
    cfg, ref = model.config, src.config
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "max_positions"):
        assert getattr(cfg, field) == getattr(ref, field), field
    assert cfg.rope_theta == 50000.0
    assert cfg.rms_eps == 1e-6
    assert cfg.tie_embeddings is False
    assert set(model.weights) == set(src.weights)
    for name, want in src.weights.items():
        got = model.weights[name]
        assert got.dtype == np.float32 and got.flags.c_contiguous, name
        assert got.shape == want.shape, name
        np.testing.assert_array_equal(got, want, err_msg=name)
    assert model.source == str(path)
    assert model.name == path.stem  # served under the file name, not general.name ("tiny-test")


def _root(a):
    while isinstance(a, np.ndarray) and a.base is not None:
        a = a.base
    return a.obj if isinstance(a, memoryview) else a


def test_weights_are_writeable_and_a_load_from_the_cache_maps_it_copy_on_write(tmp_path):
    """The cache's weights are mapped, not read (a driver on block codes reads few of them),
    and copy-on-write: they stay writeable, and a write stays in the process, never in the
    cache file another start will read. The load that writes the entry maps it too: the
    float32 copies it dequantized are not kept."""
    path = tmp_path / "tiny.gguf"
    write_gguf(path)
    uncached = load_gguf(path, cache=False)
    for name, arr in uncached.weights.items():
        assert arr.flags.writeable and arr.flags.c_contiguous, name
        assert not isinstance(_root(arr), np.memmap | mmap.mmap | bytes), name  # dequantized here
    first = load_gguf(path, cache=True, cache_dir=tmp_path / "cache")
    cached = load_gguf(path, cache=True, cache_dir=tmp_path / "cache")
    for model in (first, cached):
        assert model.source == str(path)
        for name, arr in model.weights.items():
            assert arr.flags.writeable and arr.flags.c_contiguous and arr.dtype == np.float32, name
            assert isinstance(_root(arr), mmap.mmap), name
            np.testing.assert_array_equal(arr, uncached.weights[name])
    name = next(iter(cached.weights))
    cached.weights[name][...] = 7.0
    again = load_gguf(path, cache=True, cache_dir=tmp_path / "cache")
    np.testing.assert_array_equal(again.weights[name], uncached.weights[name])


@pytest.mark.parametrize("qtype, rtol_of_max", [(Q.F16, 1e-3), (Q.BF16, 1e-2), (Q.Q8_0, 1e-2),
                                                 (Q.Q4_0, 0.15), (Q.Q4_1, 0.1), (Q.Q5_0, 0.07)])
def test_quantized_round_trip_within_tolerance(tmp_path, qtype, rtol_of_max):
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    src = write_gguf(path, seed=2, qtype=qtype)
    model = load_gguf(path)
    for name, want in src.weights.items():
        got = model.weights[name]
        assert got.shape == want.shape and got.dtype == np.float32, name
        err = np.abs(got - want).max()
        assert err <= rtol_of_max * np.abs(want).max() + 1e-7, (name, err)
        # The exact values are gguf's own dequantization of what was written.
        if want.ndim == 2:
            q = gguf.quants.quantize(want, qtype) if qtype not in (Q.F16,) else want.astype(np.float16)
            exact = gguf.quants.dequantize(q, qtype)
            np.testing.assert_array_equal(got, exact, err_msg=name)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_k_quant_tensors_are_dequantized_with_the_right_shape(tmp_path, qtype):
    # gguf-py cannot quantize K-quants, and the tiny model's rows are shorter than a K-quant
    # block: raw blocks in an extra tensor exercise the loader's per-tensor path instead.
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = 64, 2 * block
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 16, (rows, cols // block * size), dtype=np.uint8)  # small, finite scales
    path = tmp_path / "k.gguf"
    write_gguf(path, extra_tensors={"extra.k.weight": (raw, qtype)})
    reader = gguf.GGUFReader(str(path))
    tensor = next(t for t in reader.tensors if t.name == "extra.k.weight")
    got = gguf_loader.dequantize_tensor(tensor)
    want = gguf.quants.dequantize(raw, qtype)
    assert got.shape == (rows, cols) and got.dtype == np.float32 and got.flags.c_contiguous
    np.testing.assert_array_equal(got, want)


def test_tied_output_when_output_weight_is_absent(tmp_path):
    path = tmp_path / "tied.gguf"
    src = write_gguf(path, tied=True)
    model = load_gguf(path)
    assert model.config.tie_embeddings is True
    assert "lm_head" not in model.weights
    np.testing.assert_array_equal(model.weights["embed"], src.weights["embed"])


def test_tokenizer_and_template_come_from_metadata(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(path)
    model = load_gguf(path)
    tok = model.tokenizer
    text = "héllo, wörld 123 ✓"
    assert tok.encode(text) == list(text.encode("utf-8"))
    assert tok.decode(tok.encode(text)) == text
    assert tok.bos_token_id == 256 and 257 in tok.eos_token_ids and tok.add_bos is True
    assert tok.vocab_size == 258
    assert model.encode_prompt("a") == [256, 97]
    assert tok.encode("<s>x</s>") == [256, 120, 257]
    assert tok.decode([256, 104, 105, 257]) == "hi"  # special tokens carry no text
    assert model.chat_template == SMOLLM2_TEMPLATE
    assert model.special_tokens["bos_token"] == "<s>" and model.special_tokens["eos_token"] == "</s>"


def test_add_bos_defaults_to_off_for_gpt2_vocab(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, tokenizer={"add_bos_token": None})
    assert load_gguf(path).tokenizer.add_bos is False


def test_missing_rope_theta_and_eps_use_llama_defaults(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, skip_keys=("rope.freq_base", "attention.layer_norm_rms_epsilon", "rope.dimension_count",
                                "context_length"))
    cfg = load_gguf(path).config
    assert cfg.rope_theta == 10000.0 and cfg.rms_eps == 1e-5 and cfg.max_positions == 2048
    assert cfg.head_dim == 16


# ---- errors ----------------------------------------------------------------------------

def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError) as err:
        load_gguf(tmp_path / "nope.gguf")
    assert_one_line(err, "not found", "nope.gguf")


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"this is not a model at all" * 10)
    with pytest.raises(ModelLoadError) as err:
        load_gguf(path)
    assert_one_line(err, "not a GGUF file")


def test_empty_file(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(ModelLoadError) as err:
        load_gguf(path)
    assert_one_line(err, "empty")


@pytest.mark.parametrize("keep", [0.9, 0.5, 0.02, 10])
def test_truncated_file(tmp_path, keep):
    path = tmp_path / "tiny.gguf"
    write_gguf(path)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)] if keep < 1 else data[:keep])
    with pytest.raises(ModelLoadError) as err:
        load_gguf(cut)
    assert_one_line(err, "truncated")


def test_corrupt_header(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(path)
    data = bytearray(path.read_bytes())
    data[8:24] = b"\xff" * 16  # absurd tensor and key counts
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError) as err:
        load_gguf(path)
    assert_one_line(err, "corrupt")


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    write_gguf(path, arch="gpt2")
    with pytest.raises(ModelLoadError) as err:
        load_gguf(path)
    assert_one_line(err, "architecture", "gpt2")


def test_unsupported_tensor_type(tmp_path):
    path = tmp_path / "iq.gguf"
    block, size = gguf.GGML_QUANT_SIZES[Q.IQ2_XXS]
    raw = np.zeros((64, 256 // block * size), dtype=np.uint8)
    write_gguf(path, skip_tensors=("blk.0.ffn_up.weight",), extra_tensors={"blk.0.ffn_up.weight": (raw, Q.IQ2_XXS)})
    with pytest.raises(ModelLoadError) as err:
        load_gguf(path)
    assert_one_line(err, "blk.0.ffn_up.weight", "IQ2_XXS")


def test_missing_tensor(tmp_path):
    path = tmp_path / "hole.gguf"
    write_gguf(path, skip_tensors=("blk.1.attn_k.weight",))
    with pytest.raises(ModelLoadError) as err:
        load_gguf(path)
    assert_one_line(err, "missing", "blk.1.attn_k.weight")


def test_unknown_tensor_is_refused_not_ignored(tmp_path):
    path = tmp_path / "bias.gguf"
    write_gguf(path, extra_tensors={"blk.0.attn_q.bias": (np.zeros(64, np.float32), None)})
    with pytest.raises(ModelLoadError) as err:
        load_gguf(path)
    assert_one_line(err, "blk.0.attn_q.bias")


def test_wrong_tensor_shape(tmp_path):
    path = tmp_path / "shape.gguf"
    write_gguf(path, skip_tensors=("blk.0.ffn_up.weight",),
               extra_tensors={"blk.0.ffn_up.weight": (np.zeros((64, 64), np.float32), None)})
    with pytest.raises(ModelLoadError) as err:
        load_gguf(path)
    assert_one_line(err, "blk.0.ffn_up.weight", "shape")


def test_missing_metadata_key(tmp_path):
    path = tmp_path / "nokey.gguf"
    write_gguf(path, skip_keys=("block_count",))
    with pytest.raises(ModelLoadError) as err:
        load_gguf(path)
    assert_one_line(err, "llama.block_count")


def test_rope_scaling_is_refused(tmp_path):
    path = tmp_path / "rope.gguf"
    write_gguf(path, extra_tensors={"rope_freqs.weight": (np.ones(8, np.float32), None)})
    with pytest.raises(ModelLoadError) as err:
        load_gguf(path)
    assert_one_line(err, "rope")


def test_unsupported_tokenizer_model(tmp_path):
    path = tmp_path / "tok.gguf"
    write_gguf(path, tokenizer={"model": "bert"})
    with pytest.raises(ModelLoadError) as err:
        load_gguf(path)
    assert_one_line(err, "tokenizer", "bert")


# ---- the cache ---------------------------------------------------------------------------

def test_cache_round_trip_skips_the_reader(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    src = write_gguf(path, seed=4, qtype=Q.Q8_0)
    cache = tmp_path / "cache"
    first = load_gguf(path, cache=True, cache_dir=cache)
    entries = list(cache.rglob("weights.safetensors"))
    assert len(entries) == 1

    def refuse(*a, **k):
        raise AssertionError("the cache was not used")

    monkeypatch.setattr(gguf_loader, "open_reader", refuse)
    second = load_gguf(path, cache=True, cache_dir=cache)
    assert set(second.weights) == set(src.weights)
    for name in first.weights:
        np.testing.assert_array_equal(second.weights[name], first.weights[name], err_msg=name)
        assert second.weights[name].dtype == np.float32 and second.weights[name].flags.c_contiguous
    assert second.config == first.config
    assert second.chat_template == first.chat_template
    assert second.special_tokens == first.special_tokens
    assert second.name == first.name and second.source == first.source
    tok1, tok2 = first.tokenizer, second.tokenizer
    assert (tok2.eos_token_ids, tok2.bos_token_id, tok2.add_bos, tok2.vocab_size) == (
        tok1.eos_token_ids, tok1.bos_token_id, tok1.add_bos, tok1.vocab_size)
    assert tok2.encode("héllo <s>") == tok1.encode("héllo <s>")


def test_cache_is_invalidated_when_the_file_changes(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, seed=1)
    cache = tmp_path / "cache"
    a = load_gguf(path, cache=True, cache_dir=cache)
    src = write_gguf(path, seed=2)
    os.utime(path, ns=(1, 1_000_000_000))  # a different mtime even on coarse clocks
    b = load_gguf(path, cache=True, cache_dir=cache)
    np.testing.assert_array_equal(b.weights["embed"], src.weights["embed"])
    assert not np.array_equal(a.weights["embed"], b.weights["embed"])
    # the stale entry for the same file is removed
    assert len(list(cache.rglob("weights.safetensors"))) == 1


def test_cache_is_off_for_small_files_by_default(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(path)
    cache = tmp_path / "cache"
    load_gguf(path, cache_dir=cache)
    assert not list(cache.rglob("weights.safetensors"))


def test_a_corrupt_cache_entry_is_ignored(tmp_path):
    path = tmp_path / "tiny.gguf"
    src = write_gguf(path, seed=3)
    cache = tmp_path / "cache"
    load_gguf(path, cache=True, cache_dir=cache)
    (entry,) = cache.rglob("weights.safetensors")
    entry.write_bytes(b"garbage")
    model = load_gguf(path, cache=True, cache_dir=cache)
    np.testing.assert_array_equal(model.weights["embed"], src.weights["embed"])


def test_cache_defaults_follow_size_and_poot_no_cache(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_gguf(path)
    monkeypatch.setattr(gguf_loader, "CACHE_MIN_BYTES", 0)  # every file counts as large
    monkeypatch.setenv("POOT_CACHE_DIR", str(tmp_path / "env-cache"))
    monkeypatch.setenv("POOT_NO_CACHE", "1")
    load_gguf(path)
    assert not (tmp_path / "env-cache").exists()
    monkeypatch.delenv("POOT_NO_CACHE")
    load_gguf(path)
    assert len(list((tmp_path / "env-cache" / "gguf").glob("*/weights.safetensors"))) == 1


def _codes_equal(a, b) -> bool:
    return all(getattr(a, p).dtype == getattr(b, p).dtype and np.array_equal(getattr(a, p), getattr(b, p))
               for p in ("codes", "d", "m"))


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.F32])
def test_the_cache_keeps_the_block_codes_beside_the_weights(tmp_path, monkeypatch, qtype):
    """The codes a load from the cache hands on are the ones block_codes.find gives for its
    weights, every weight that has codes is named, and the family's product codes built from
    them are the ones built by searching."""
    from poot.engine.models import block_codes, llama

    path = tmp_path / "tiny.gguf"
    write_gguf(path, seed=5, qtype=qtype)
    cache = tmp_path / "cache"
    first = load_gguf(path, cache=True, cache_dir=cache)
    monkeypatch.setattr(gguf_loader, "open_reader", lambda *a, **k: pytest.fail("the cache was not used"))
    monkeypatch.setattr(block_codes, "find", lambda w: pytest.fail("codes were searched for"))
    second = load_gguf(path, cache=True, cache_dir=cache)
    monkeypatch.undo()
    searched = {name: c for name, w in second.weights.items() if (c := block_codes.find(w)) is not None}
    assert bool(searched) == (qtype != Q.F32)
    for model in (first, second):
        assert set(model.block_codes) == set(searched)
        assert all(_codes_equal(model.block_codes[n], c) for n, c in searched.items())
    known = llama.block_codes(second.config, second.weights, second.block_codes)
    found = llama.block_codes(second.config, second.weights)
    assert set(known) == set(found)
    for name, (codes, scale) in found.items():
        assert _codes_equal(known[name][0], codes), name
        assert (scale is None) == (known[name][1] is None) and (scale is None or np.array_equal(scale, known[name][1]))


def test_a_corrupt_codes_file_is_ignored_with_one_log_line(tmp_path, caplog):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, seed=6, qtype=Q.Q8_0)
    cache = tmp_path / "cache"
    want = load_gguf(path, cache=True, cache_dir=cache)
    (codes,) = cache.rglob("codes.safetensors")
    codes.write_bytes(codes.read_bytes()[:100])
    with caplog.at_level("WARNING"):
        model = load_gguf(path, cache=True, cache_dir=cache)
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "ignoring" in caplog.records[0].getMessage()
    assert set(model.block_codes) == set(want.block_codes) and model.block_codes
    assert load_gguf(path, cache=True, cache_dir=cache).block_codes.keys() == want.block_codes.keys()  # rewritten


def test_a_load_reports_its_progress(tmp_path):
    from poot.engine.progress import Progress

    path = tmp_path / "tiny.gguf"
    write_gguf(path, seed=7, qtype=Q.Q8_0)
    for expected in ("reading tiny.gguf", "reading the cached weights of tiny.gguf"):
        progress, seen = Progress(), []
        progress.listen(seen.append)
        load_gguf(path, cache=True, cache_dir=tmp_path / "cache", progress=progress)
        assert {s.phase for s in seen} == {"model"}
        assert any(s.detail.startswith(expected) for s in seen), [s.detail for s in seen]


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_block_quantized_matrices_are_read_as_codes_and_the_cache_keeps_no_float_copy_of_them(tmp_path, monkeypatch,
                                                                                            qtype):
    """A Q4_0/Q4_1/Q8_0 matrix is read as the file's codes, never dequantized at load; read by
    name it gives the values gguf-py dequantizes, bit for bit (rows unpermuted as for float
    weights); the cache's float32 file holds the norms and the embedding only; and a weight's
    shape is known without making its values."""
    from poot.engine.models import gguf_file

    path = tmp_path / "tiny.gguf"
    config = write_gguf(path, seed=6, qtype=qtype).config
    real = gguf_file.dequantize_tensor
    expected = {}  # gguf-py's dequantized values, rows unpermuted
    for tensor in gguf_file.open_reader(path).tensors:
        canon = gguf_loader._canonical_name(tensor.name, config.num_layers)
        heads = {".wq": config.num_heads, ".wk": config.num_kv_heads}.get(canon[-3:])
        w = real(tensor)
        expected[canon] = w if heads is None else gguf_loader.unpermute_rows(w, heads)

    def refuse_matrices(tensor):
        if tensor.tensor_type == qtype:
            raise AssertionError(f"{tensor.name} was dequantized at load")
        return real(tensor)

    monkeypatch.setattr(gguf_loader, "dequantize_tensor", refuse_matrices)
    model = load_gguf(path, cache=True, cache_dir=tmp_path / "cache")
    monkeypatch.undo()
    matrices = {n for n, shape in model.weight_shapes().items() if len(shape) == 2}
    assert set(model.block_codes) == matrices
    floats = gguf_loader.map_tensors(next((tmp_path / "cache").rglob("weights.safetensors")))
    assert set(floats) == {n for n in model.weights if n not in matrices} | {"embed"}
    for name in model.weights:
        np.testing.assert_array_equal(model.weights[name], expected[name], err_msg=name)
        assert model.weights[name].dtype == np.float32 and model.weights[name].flags.c_contiguous
    uncached = gguf_loader._read_model(path)
    np.testing.assert_array_equal(uncached.weights["layers.0.wq"], expected["layers.0.wq"])
    shapes = {name: w.shape for name, w in expected.items()}
    monkeypatch.setattr(type(model.block_codes["layers.0.wq"]), "values",
                        lambda self: pytest.fail("a shape made a weight's values"))
    assert model.weight_shapes() == shapes
