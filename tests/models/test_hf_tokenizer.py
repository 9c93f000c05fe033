"""Tokenizers from GGUF metadata (byte-level BPE and SentencePiece) and from HF folders."""

from __future__ import annotations

import pytest

from poot.engine.models import ModelLoadError
from poot.engine.models.hf_tokenizer import (
    BYTE,
    CONTROL,
    NORMAL,
    UNKNOWN,
    USER_DEFINED,
    GGUFVocab,
    spm_merges,
    tokenizer_from_gguf,
)

from .helpers import byte_vocab, bytes_to_unicode


def gpt2_vocab(pre: str, extra: list[str] = (), merges: list[str] = ()) -> GGUFVocab:
    tokens, types = byte_vocab()
    tokens = tokens + list(extra)
    types = types + [NORMAL] * len(extra)
    return GGUFVocab(model="gpt2", tokens=tokens, token_types=types, merges=list(merges), pre=pre,
                     bos_id=256, eos_id=257)


def test_byte_level_bpe_applies_merges_in_rank_order():
    g = bytes_to_unicode()
    sp = g[ord(" ")]
    vocab = gpt2_vocab("default", extra=["ab", "abc", sp + "ab"], merges=["a b", "ab c", f"{sp} ab"])
    tok, _ = tokenizer_from_gguf(vocab)
    assert tok.encode("abc ab") == [259, 260]
    assert tok.decode([259, 260]) == "abc ab"


def test_smollm_pre_tokenizer_splits_digits_one_by_one():
    vocab = dict(extra=["12", "123"], merges=["1 2", "12 3"])
    default, _ = tokenizer_from_gguf(gpt2_vocab("default", **vocab))
    smollm, _ = tokenizer_from_gguf(gpt2_vocab("smollm", **vocab))
    assert default.encode("123") == [259]
    assert smollm.encode("123") == [ord("1"), ord("2"), ord("3")]
    assert smollm.decode(smollm.encode("a 123 b")) == "a 123 b"


def test_llama3_pre_tokenizer_groups_digits_by_three():
    vocab = dict(extra=["12", "123"], merges=["1 2", "12 3"])
    tok, _ = tokenizer_from_gguf(gpt2_vocab("llama-bpe", **vocab))
    assert tok.encode("1234") == [259, ord("4")]


def test_unknown_pre_tokenizer_is_refused():
    with pytest.raises(ModelLoadError, match="pre-tokenizer 'mystery'"):
        tokenizer_from_gguf(gpt2_vocab("mystery"))


def test_merge_of_unknown_tokens_is_a_load_error():
    with pytest.raises(ModelLoadError, match="BPE"):
        tokenizer_from_gguf(gpt2_vocab("default", merges=["zz qq"]))


def test_eos_set_includes_end_of_turn_control_tokens():
    tokens, types = byte_vocab()
    tokens += ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool>"]
    types += [CONTROL, CONTROL, CONTROL, USER_DEFINED]
    vocab = GGUFVocab(model="gpt2", tokens=tokens, token_types=types, pre="default", bos_id=258, eos_id=259)
    tok, special = tokenizer_from_gguf(vocab)
    assert tok.eos_token_ids == frozenset({257, 259, 260})  # </s>, <|im_end|>, <|endoftext|>
    assert special == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    assert tok.encode("<|im_start|>x<tool>") == [258, ord("x"), 261]
    assert tok.decode([258, ord("x"), 261, 259]) == "x<tool>"  # user-defined tokens keep their text


def test_ids_outside_the_vocab_are_refused():
    vocab = gpt2_vocab("default")
    vocab.eos_id = 10_000
    with pytest.raises(ModelLoadError, match="eos id 10000"):
        tokenizer_from_gguf(vocab)


def spm_vocab(add_space_prefix=True) -> GGUFVocab:
    pieces = [("<unk>", UNKNOWN, 0.0), ("<s>", CONTROL, 0.0), ("</s>", CONTROL, 0.0)]
    pieces += [(f"<0x{b:02X}>", BYTE, 0.0) for b in range(256)]
    normal = ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "llo", "hello", "▁hello", "▁w", "or", "▁wor", "ld", "▁world"]
    pieces += [(p, NORMAL, -float(i)) for i, p in enumerate(normal)]
    return GGUFVocab(model="llama", tokens=[p for p, _, _ in pieces], token_types=[t for _, t, _ in pieces],
                     scores=[s for _, _, s in pieces], bos_id=1, eos_id=2, unk_id=0,
                     add_space_prefix=add_space_prefix)


def test_sentencepiece_vocab_merges_by_score():
    vocab = spm_vocab()
    merges = spm_merges(vocab.tokens, vocab.scores, vocab.token_types)
    assert merges[0] == ("h", "e")  # "he" has the best score of all merged pieces
    tok, special = tokenizer_from_gguf(vocab)
    ids = tok.encode("hello world")
    assert [tok.id_to_token(i) for i in ids] == ["▁hello", "▁world"]
    assert tok.decode(ids) == "hello world"
    assert tok.add_bos is True and tok.bos_token_id == 1 and 2 in tok.eos_token_ids
    assert special["bos_token"] == "<s>" and special["unk_token"] == "<unk>"


def test_sentencepiece_byte_fallback_round_trips_unknown_characters():
    tok, _ = tokenizer_from_gguf(spm_vocab())
    ids = tok.encode("hé")
    pieces = [tok.id_to_token(i) for i in ids]
    assert "<0xC3>" in pieces and "<0xA9>" in pieces
    assert tok.decode(ids) == "hé"


def test_sentencepiece_without_space_prefix():
    tok, _ = tokenizer_from_gguf(spm_vocab(add_space_prefix=False))
    assert tok.id_to_token(tok.encode("hello")[0]) == "hello"
    assert tok.decode(tok.encode("hello world")) == "hello world"


def test_sentencepiece_needs_scores():
    vocab = spm_vocab()
    vocab.scores = None
    with pytest.raises(ModelLoadError, match="scores"):
        tokenizer_from_gguf(vocab)


def test_unknown_tokenizer_model():
    vocab = gpt2_vocab("default")
    vocab.model = "bert"
    with pytest.raises(ModelLoadError, match="'bert'"):
        tokenizer_from_gguf(vocab)


# ---- SmolLM2 ---------------------------------------------------------------------------

@pytest.mark.realmodel
def test_smollm2_special_tokens_and_flags(smollm2):
    tok = smollm2.tokenizer
    assert tok.vocab_size == 49152
    assert tok.add_bos is False and smollm2.encode_prompt("Hi") == tok.encode("Hi")
    assert 2 in tok.eos_token_ids  # <|im_end|>, the eos in the metadata
    assert tok.id_to_token(2) == "<|im_end|>" and tok.id_to_token(0) == "<|endoftext|>"
    assert 0 in tok.eos_token_ids
    assert smollm2.special_tokens["eos_token"] == "<|im_end|>"
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]


@pytest.mark.realmodel
@pytest.mark.parametrize("text, pieces", [
    ("123", ["1", "2", "3"]),
    ("Hello world", ["Hello", "Ġworld"]),
    ("x 12", ["x", "Ġ", "1", "2"]),
    ("<|im_start|>user\nHi<|im_end|>\n", ["<|im_start|>", "user", "Ċ", "Hi", "<|im_end|>", "Ċ"]),
])
def test_smollm2_pieces(smollm2, text, pieces):
    tok = smollm2.tokenizer
    assert [tok.id_to_token(i) for i in tok.encode(text)] == pieces


@pytest.mark.realmodel
@pytest.mark.parametrize("text", ["héllo wörld", "naïve café 😀 — ok", "  two  spaces\n\nand\ttabs", "3.14159 + 2 = 5.14159",
                                  "日本語のテキスト"])
def test_smollm2_tokens_spell_the_text(smollm2, text):
    """Each id's token string, read through GPT-2's byte table, gives back the UTF-8 bytes."""
    from .helpers import bytes_to_unicode

    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    tok = smollm2.tokenizer
    ids = tok.encode(text)
    raw = b"".join(bytes(to_byte[c] for c in tok.id_to_token(i)) for i in ids)
    assert raw == text.encode("utf-8")
    assert tok.decode(ids) == text
    digits = [tok.id_to_token(i) for i in ids if any(ch.isdigit() for ch in tok.id_to_token(i))]
    assert all(len(d) == 1 for d in digits), digits  # digits one by one
