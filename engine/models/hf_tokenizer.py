"""Tokenizers built on the `tokenizers` package, from GGUF metadata or a Hugging Face folder.

GGUF vocabularies:
- "gpt2": byte-level BPE from `tokenizer.ggml.tokens` and `tokenizer.ggml.merges`, with the
  pre-tokenizer `tokenizer.ggml.pre` names (e.g. "smollm" splits digits one by one before the
  GPT-2 regex, as SmolLM2's own tokenizer.json does).
- "llama": SentencePiece-style BPE rebuilt from the token scores (merges ranked by the score
  of the merged piece, as transformers' converter does), with byte fallback.
Control tokens become special added tokens: they are matched whole in text, and decode drops
them (like ByteTokenizer, special tokens carry no text).

The end-of-generation set holds the eos id, the eot/eom ids when given, and every control
token whose text is a known end-of-turn marker (`<|im_end|>`, `<|endoftext|>`, `<|eot_id|>`,
...), as llama.cpp does: a chat model that emits any of them has finished its turn.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as RustTokenizer

from .base import ModelLoadError

# gguf.TokenType values (kept here so this module needs no gguf import).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

END_OF_TURN_TEXTS = frozenset({
    "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<end_of_turn>",
    "<|end|>", "</s>", "<|return|>", "<|call|>",
})

_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
LLAMA3_PATTERN = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> (pre-tokenizer factory, ignore_merges)
_GPT2_PRE = {
    "default": (lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False),
    "gpt2": (lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False),
    "gpt-2": (lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False),
    # Digits one by one, then the GPT-2 regex: SmolLM2's tokenizer.json and llama.cpp agree.
    **{name: (lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ]), False) for name in ("smollm", "starcoder", "refact")},
    **{name: (lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]), True) for name in ("llama-bpe", "llama3")},
    "qwen2": (lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]), False),
}


class HFTokenizer:
    """The Tokenizer protocol of base.py over a `tokenizers.Tokenizer`.

    encode never adds BOS/EOS (LoadedModel.encode_prompt adds BOS when add_bos is set);
    decode drops special tokens.
    """

    def __init__(self, tokenizer: RustTokenizer, *, eos_token_ids: Sequence[int], bos_token_id: int | None,
                 add_bos: bool):
        self._tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids = frozenset(int(i) for i in eos_token_ids)
        self.bos_token_id = None if bos_token_id is None else int(bos_token_id)
        self.add_bos = bool(add_bos)

    @property
    def backend(self) -> RustTokenizer:
        return self._tok

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    def to_json(self) -> str:
        return self._tok.to_str()

    def state(self) -> dict:
        """What, besides to_json(), rebuilds this tokenizer (see from_state)."""
        return {"eos_token_ids": sorted(self.eos_token_ids), "bos_token_id": self.bos_token_id,
                "add_bos": self.add_bos}

    @classmethod
    def from_state(cls, tokenizer_json: str, state: dict) -> HFTokenizer:
        return cls(RustTokenizer.from_str(tokenizer_json), eos_token_ids=state["eos_token_ids"],
                   bos_token_id=state["bos_token_id"], add_bos=state["add_bos"])


# ---- GGUF ---------------------------------------------------------------------------------

@dataclass(slots=True)
class GGUFVocab:
    """The tokenizer.ggml.* metadata of a GGUF file, as plain Python values."""

    model: str
    tokens: list[str]
    token_types: list[int] | None = None
    scores: list[float] | None = None
    merges: list[str] | None = None
    pre: str | None = None
    bos_id: int | None = None
    eos_id: int | None = None
    eot_id: int | None = None
    eom_id: int | None = None
    unk_id: int | None = None
    add_bos: bool | None = None
    add_space_prefix: bool | None = None


def _checked_id(vocab: GGUFVocab, value: int | None, what: str) -> int | None:
    if value is None:
        return None
    if not 0 <= int(value) < len(vocab.tokens):
        raise ModelLoadError(f"tokenizer {what} id {value} is outside the vocabulary of {len(vocab.tokens)} tokens")
    return int(value)


def _add_tokens(tok: RustTokenizer, vocab: GGUFVocab) -> None:
    """Control tokens as special added tokens (no text on decode), user-defined ones as
    plain added tokens (matched whole, decoded as written)."""
    types = vocab.token_types or []
    tok.add_special_tokens([AddedToken(vocab.tokens[i], special=True, normalized=False)
                            for i, kind in enumerate(types) if kind == CONTROL])
    tok.add_tokens([AddedToken(vocab.tokens[i], special=False, normalized=False)
                    for i, kind in enumerate(types) if kind == USER_DEFINED])


def _first_index(tokens: Sequence[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    return vocab


def _gpt2_tokenizer(vocab: GGUFVocab) -> RustTokenizer:
    pre = vocab.pre or "default"
    if pre not in _GPT2_PRE:
        raise ModelLoadError(f"unsupported tokenizer pre-tokenizer {pre!r} (supported: {', '.join(sorted(_GPT2_PRE))})")
    make_pre, ignore_merges = _GPT2_PRE[pre]
    merges = []
    for m in vocab.merges or []:
        left, sep, right = m.partition(" ")
        if not sep:
            raise ModelLoadError(f"tokenizer merge {m!r} is not two tokens separated by a space")
        merges.append((left, right))
    try:
        bpe = models.BPE(vocab=_first_index(vocab.tokens), merges=merges, fuse_unk=False, byte_fallback=False,
                         ignore_merges=ignore_merges)
    except Exception as e:  # the Rust side rejects merges of unknown tokens
        raise ModelLoadError(f"inconsistent BPE tokenizer: {_one_line(e)}") from None
    tok = RustTokenizer(bpe)
    tok.pre_tokenizer = make_pre()
    tok.decoder = decoders.ByteLevel()
    return tok


def spm_merges(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int] | None) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece vocab: every split of a piece into two pieces, ranked
    by the merged piece's score (highest first), ties by the parts' ids."""
    vocab = _first_index(tokens)
    ranked = []
    for i, piece in enumerate(tokens):
        if types is not None and types[i] not in (NORMAL, USER_DEFINED):
            continue
        if vocab[piece] != i:
            continue
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            li, ri = vocab.get(left), vocab.get(right)
            if li is not None and ri is not None:
                ranked.append((-float(scores[i]), li, ri, left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _spm_tokenizer(vocab: GGUFVocab) -> RustTokenizer:
    if vocab.scores is None or len(vocab.scores) != len(vocab.tokens):
        raise ModelLoadError("a 'llama' (SentencePiece) tokenizer needs tokenizer.ggml.scores for every token")
    unk = vocab.tokens[vocab.unk_id] if vocab.unk_id is not None else None
    try:
        bpe = models.BPE(vocab=_first_index(vocab.tokens), merges=spm_merges(vocab.tokens, vocab.scores, vocab.token_types),
                         unk_token=unk, fuse_unk=True, byte_fallback=True)
    except Exception as e:
        raise ModelLoadError(f"inconsistent SentencePiece tokenizer: {_one_line(e)}") from None
    tok = RustTokenizer(bpe)
    space_prefix = True if vocab.add_space_prefix is None else vocab.add_space_prefix
    replace = normalizers.Replace(" ", "\u2581")
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), replace]) if space_prefix else replace
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def tokenizer_from_gguf(vocab: GGUFVocab) -> tuple[HFTokenizer, dict[str, str]]:
    """Builds the tokenizer; returns it with the special-token texts chat templates use."""
    if not vocab.tokens:
        raise ModelLoadError("the file has no tokenizer (tokenizer.ggml.tokens is missing)")
    if vocab.token_types is not None and len(vocab.token_types) != len(vocab.tokens):
        raise ModelLoadError("tokenizer.ggml.token_type and tokenizer.ggml.tokens differ in length")
    if vocab.model == "gpt2":
        tok = _gpt2_tokenizer(vocab)
        default_add_bos = False
    elif vocab.model == "llama":
        tok = _spm_tokenizer(vocab)
        default_add_bos = True
    else:
        raise ModelLoadError(f"unsupported tokenizer model {vocab.model!r} (supported: gpt2, llama)")
    _add_tokens(tok, vocab)

    bos = _checked_id(vocab, vocab.bos_id, "bos")
    eos = _checked_id(vocab, vocab.eos_id, "eos")
    eos_ids = {i for i in (eos, _checked_id(vocab, vocab.eot_id, "eot"), _checked_id(vocab, vocab.eom_id, "eom"))
               if i is not None}
    for i, kind in enumerate(vocab.token_types or []):
        if kind == CONTROL and vocab.tokens[i] in END_OF_TURN_TEXTS:
            eos_ids.add(i)
    add_bos = default_add_bos if vocab.add_bos is None else bool(vocab.add_bos)
    if add_bos and bos is None:
        raise ModelLoadError("the tokenizer asks for a BOS token but names none (tokenizer.ggml.bos_token_id)")
    special = {"bos_token": vocab.tokens[bos] if bos is not None else "",
               "eos_token": vocab.tokens[eos] if eos is not None else ""}
    unk = _checked_id(vocab, vocab.unk_id, "unknown")
    if unk is not None:
        special["unk_token"] = vocab.tokens[unk]
    return HFTokenizer(tok, eos_token_ids=sorted(eos_ids), bos_token_id=bos, add_bos=add_bos), special


# ---- Hugging Face folders -----------------------------------------------------------------

def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {_one_line(e)}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    return data


def _token_text(value) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _ids(value) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _folder_chat_template(folder: Path, tokenizer_config: dict) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if template is None:
        template = _read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    return template if isinstance(template, str) else None


def tokenizer_from_folder(folder: str | Path) -> tuple[HFTokenizer, str | None, dict[str, str]]:
    """tokenizer.json (+ tokenizer_config.json, config.json, generation_config.json):
    returns the tokenizer, the chat template (or None) and the special-token texts."""
    folder = Path(folder)
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder} has no tokenizer.json")
    try:
        tok = RustTokenizer.from_file(str(path))
    except Exception as e:
        raise ModelLoadError(f"cannot read {path}: {_one_line(e)}") from None
    tc = _read_json(folder / "tokenizer_config.json")
    config = _read_json(folder / "config.json")
    generation = _read_json(folder / "generation_config.json")

    bos_text, eos_text = _token_text(tc.get("bos_token")), _token_text(tc.get("eos_token"))
    bos_id = tok.token_to_id(bos_text) if bos_text else None
    if bos_id is None:
        ids = _ids(config.get("bos_token_id"))
        bos_id = ids[0] if ids else None
    if bos_text is None and bos_id is not None:
        bos_text = tok.id_to_token(bos_id)
    eos_ids = set(_ids(config.get("eos_token_id"))) | set(_ids(generation.get("eos_token_id")))
    if eos_text and tok.token_to_id(eos_text) is not None:
        eos_ids.add(tok.token_to_id(eos_text))
    if eos_text is None and eos_ids:
        eos_text = tok.id_to_token(min(eos_ids))
    size = tok.get_vocab_size(with_added_tokens=True)
    eos_ids = {i for i in eos_ids if 0 <= i < size}

    add_bos = tc.get("add_bos_token")
    if not isinstance(add_bos, bool):
        # No flag: does the tokenizer's own post-processor put BOS in front?
        with_special = tok.encode("a", add_special_tokens=True).ids
        add_bos = bos_id is not None and len(with_special) > 0 and with_special[0] == bos_id and \
            with_special != tok.encode("a", add_special_tokens=False).ids
    if add_bos and bos_id is None:
        add_bos = False
    special = {"bos_token": bos_text or "", "eos_token": eos_text or ""}
    for name in ("unk_token", "pad_token"):
        text = _token_text(tc.get(name))
        if text:
            special[name] = text
    hf = HFTokenizer(tok, eos_token_ids=sorted(eos_ids), bos_token_id=bos_id, add_bos=add_bos)
    return hf, _folder_chat_template(folder, tc), special


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text or type(e).__name__
