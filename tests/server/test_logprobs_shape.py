"""The two OpenAI logprobs shapes, built from engine events on the byte tokenizer."""

from __future__ import annotations

import math

from poot.engine.models.byte_tokenizer import ByteTokenizer
from poot.server.logprobs_shape import CompletionLogprobs, TokenTexts, chat_content, merge_completion


def test_a_character_split_over_tokens_keeps_its_bytes():
    texts = TokenTexts(ByteTokenizer())
    ids = list("a☃".encode())
    entries = chat_content(texts, ids, [-0.1] * len(ids), [((i, -0.1),) for i in ids])
    assert bytes(b for e in entries for b in e["bytes"]).decode() == "a☃"
    assert [e["token"] for e in entries] == ["a", "\ufffd", "\ufffd", "\ufffd"]
    assert entries[1]["top_logprobs"][0]["bytes"] == [0xE2]


def test_completion_offsets_run_across_chunks_and_the_picked_token_is_always_listed():
    shape = CompletionLogprobs(TokenTexts(ByteTokenizer()))
    first = shape.shape([104, 105], [None, -1.0], [(), ((106, -0.5),)])
    second = shape.shape([33], [-math.inf], [((33, -math.inf),)])
    merged = merge_completion([first, second])
    assert merged["tokens"] == ["h", "i", "!"] and merged["text_offset"] == [0, 1, 2]
    assert merged["token_logprobs"] == [None, -1.0, -9999.0]  # JSON has no -inf
    assert merged["top_logprobs"] == [None, {"j": -0.5, "i": -1.0}, {"!": -9999.0}]
