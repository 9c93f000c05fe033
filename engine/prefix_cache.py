"""Prefix reuse: prompt blocks registered by a released request, mapped by later ones.

Each whole prompt block is keyed by a digest chained over the model name and the tokens of
every block up to and including it, so equal keys mean equal prefixes. Each entry also keeps
its parent's key and its own tokens, and a lookup or registration checks both, so even a
digest collision can never map a wrong block.

A hit is shared, never copied: the block's reference count goes up and the request starts
its prefill past it. At least one prompt token is always computed (the logits of the last
one are needed), so hits stop at len(prompt) - 1 tokens, rounded down to a whole block.
A request's blocks go back to the pool when it is released; the registered ones stay cached
(counted as room) until an allocation needs them, least recently used first.

Recurrent-state families (plan.num_blocks == 0) register nothing: a block would hold none of
the state a later request needs. `release` says so by returning None.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from .blocks import BlockPool
from .plan import Plan
from .sequence import Sequence


def block_key(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    return hashlib.blake2b(parent + np.asarray(tokens, np.int64).tobytes(), digest_size=16).digest()


@dataclass(slots=True, frozen=True)
class Entry:
    key: bytes
    parent: bytes
    tokens: tuple[int, ...]


class PrefixCache:
    def __init__(self, pool: BlockPool, plan: Plan, model_name: str):
        self.pool = pool
        self.block_size = plan.block_size
        self.recurrent = plan.num_blocks == 0
        self.root = hashlib.blake2b(model_name.encode(), digest_size=16).digest()
        self.by_key: dict[bytes, int] = {}
        self.entries: dict[int, Entry] = {}  # registered block -> what it holds
        pool.on_evict = self._forget

    def num_cached_free(self) -> int:
        return self.pool.num_cached

    def open(self, seq: Sequence, need: int, extra: int = 0) -> list[int] | None:
        """The block table for `need` blocks, starting with the prompt's cached blocks; None
        when the pool has no room now, with `extra` more blocks left over (a request's other
        choices). Sets seq.num_computed to the tokens served. A prompt being scored (echo)
        takes no hits: it needs the logits of every position."""
        hits = self.match(seq.prompt) if seq.params.prompt_logprobs is None else []
        reused_cached = sum(1 for b in hits if self.pool.ref_counts[b] == 0)  # leave the room count
        if need - len(hits) + extra > self.pool.num_free - reused_cached:
            return None
        for b in hits:
            self.pool.hold(b)
        seq.num_computed = len(hits) * self.block_size
        return hits + self.pool.allocate(need - len(hits))

    def match(self, prompt: list[int]) -> list[int]:
        """Registered blocks that hold the prompt's leading whole blocks, never its last token."""
        bs, key, hits = self.block_size, self.root, []
        for i in range((len(prompt) - 1) // bs):
            tokens = tuple(prompt[i * bs : (i + 1) * bs])
            parent, key = key, block_key(key, tokens)
            b = self.by_key.get(key)
            if b is None or self.entries[b] != Entry(key, parent, tokens):
                break
            hits.append(b)
        return hits

    def release(self, seq: Sequence) -> int | None:
        """Registers the prompt's filled whole blocks and frees the sequence's blocks. Returns
        the prompt tokens newly registered, or None when the family registers nothing."""
        filled = min(seq.num_computed, len(seq.prompt)) // self.block_size
        if self.recurrent:
            return None
        registered = self.register_prefix(seq.prompt, seq.block_table[:filled])
        # Last blocks first: a chain's tail holds the most tokens and is the least likely hit,
        # so it becomes the least recently used and is evicted first.
        self.pool.free(reversed(seq.block_table))
        return registered

    def register_prefix(self, prompt: list[int], blocks: list[int]) -> int:
        bs, key, added = self.block_size, self.root, 0
        for i, b in enumerate(blocks):
            tokens = tuple(prompt[i * bs : (i + 1) * bs])
            parent, key = key, block_key(key, tokens)
            entry = Entry(key, parent, tokens)
            held = self.by_key.get(key)
            if held is None:
                self.by_key[key] = b
                self.entries[b] = entry
                self.pool.register(b)
                added += bs
            elif self.entries[held] != entry:
                break  # a digest collision: nothing past it can be keyed safely
            # else: this prefix is registered already (maybe in another block, computed
            # concurrently); ours stays unregistered and goes back as a plain free block.
        return added

    def _forget(self, block: int) -> None:
        entry = self.entries.pop(block, None)
        if entry is not None and self.by_key.get(entry.key) == block:
            del self.by_key[entry.key]
