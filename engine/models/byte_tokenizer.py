"""A byte-level tokenizer for synthetic models: token i < 256 is byte i."""

from __future__ import annotations

from collections.abc import Sequence

BOS_ID = 256
EOS_ID = 257


class ByteTokenizer:
    vocab_size = 258
    eos_token_ids = frozenset({EOS_ID})
    bos_token_id = BOS_ID
    add_bos = True

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        # Special tokens carry no text; a cut multi-byte character decodes to U+FFFD, which
        # the detokenizer treats as "not yet complete".
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes (a byte token may hold part of a character)."""
        return bytes([token_id]) if token_id < 256 else b""
