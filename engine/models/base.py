"""What a loaded model is, whatever file it came from.

Weights use one canonical naming and layout for the Llama family, in the Hugging Face
orientation ([out_features, in_features]) and with the rotary halves convention
("rotate_half"): loaders convert to it, and the forward code reads only it.

    embed                 (vocab, hidden)
    layers.{i}.attn_norm  (hidden,)
    layers.{i}.wq         (heads * head_dim, hidden)
    layers.{i}.wk         (kv_heads * head_dim, hidden)
    layers.{i}.wv         (kv_heads * head_dim, hidden)
    layers.{i}.wo         (hidden, heads * head_dim)
    layers.{i}.mlp_norm   (hidden,)
    layers.{i}.w_gate     (intermediate, hidden)
    layers.{i}.w_up       (intermediate, hidden)
    layers.{i}.w_down     (hidden, intermediate)
    norm                  (hidden,)
    lm_head               (vocab, hidden); absent when tied to embed
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np


class ModelLoadError(Exception):
    """A model file that cannot be served; the message names the problem in one line."""


@dataclass(slots=True, frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    max_positions: int = 2048
    tie_embeddings: bool = True
    family: str = "llama"
    # Recurrent families keep per-row state instead of per-token KV; they register no prefix.
    recurrent: bool = False

    def kv_bytes_per_token(self, itemsize: int = 4) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    def weight_count(self) -> int:
        d, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        per_layer = d * q + 2 * d * kv + q * d + 3 * d * i + 2 * d
        head = 0 if self.tie_embeddings else v * d
        return v * d + self.num_layers * per_layer + d + head

    def flops_per_token(self) -> int:
        """Matrix FLOPs of one token through the weights (attention over context excluded)."""
        d, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        per_layer = d * q + 2 * d * kv + q * d + 3 * d * i
        return 2 * (self.num_layers * per_layer + v * d)


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_ids: frozenset[int]
    bos_token_id: int | None
    add_bos: bool

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(slots=True)
class LoadedModel:
    name: str
    config: Any  # LlamaConfig, or another family's config
    weights: dict[str, np.ndarray]
    tokenizer: Tokenizer
    chat_template: str | None = None
    special_tokens: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token for templates
    source: str = ""  # path it was loaded from
    # The exact block codes of weights (engine/models/block_codes.py) by name, where the loader
    # knows them (the GGUF cache keeps them beside the float32 weights): every weight that has
    # codes is named. None: nobody looked; whoever wants codes finds them from the values.
    block_codes: dict[str, Any] | None = None

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight's shape by name, without making a float32 copy of any held only as
        block codes (coded_weights.py)."""
        shapes = getattr(self.weights, "shapes", None)
        return shapes() if shapes is not None else {name: w.shape for name, w in self.weights.items()}

    def encode_prompt(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text)
        if self.tokenizer.add_bos and self.tokenizer.bos_token_id is not None:
            ids = [self.tokenizer.bos_token_id, *ids]
        return ids
