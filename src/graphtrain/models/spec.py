"""The shape of a reference model (what `GPT2` and `BERT` are built from; presets.py names the shapes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True)
class ModelSpec:
    """The shape of a reference model; everything `GPT2` and `BERT` need to build themselves."""

    family: Literal["gpt2", "bert"]
    n_layer: int
    n_head: int
    d_model: int
    d_ff: int | None = None  # None: 4 * d_model
    vocab_size: int
    max_seq_len: int
    dropout: float = 0.1
    layer_norm_eps: float = 1e-5
    type_vocab_size: int = 2  # BERT only: segment (token type) embeddings
    hf_type: str | None = None
    """model.hf models: the transformers model_type (the family then names the objective: gpt2 causal, bert masked)."""

    def __post_init__(self) -> None:
        if self.family not in ("gpt2", "bert"):
            raise ValueError(f"ModelSpec.family must be 'gpt2' or 'bert', got {self.family!r}")
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model
        for name in ("n_layer", "n_head", "d_model", "d_ff", "vocab_size", "max_seq_len", "type_vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelSpec.{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ValueError(f"ModelSpec.d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"ModelSpec.dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head
