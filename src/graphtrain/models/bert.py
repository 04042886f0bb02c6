"""BERT: a bidirectional encoder trained with masked-language modelling (MLM).

The original post-LayerNorm encoder (x = LN(x + attn(x)), x = LN(x + ffn(x))) with word +
position + token-type embeddings, and the MLM head (dense, GELU, LayerNorm, decoder tied to the
word embeddings plus its own bias). No pooler and no next-sentence head: the parameter count is
that of Hugging Face's BertForMaskedLM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphtrain.models.layers import (
    MLP,
    AttentionImpl,
    SelfAttention,
    check_input_ids,
    check_seq_len,
    identity,
    language_model_loss,
    padding_mask,
)
from graphtrain.models.spec import ModelSpec


class Embeddings(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.word = nn.Embedding(spec.vocab_size, spec.d_model)
        self.position = nn.Embedding(spec.max_seq_len, spec.d_model)
        self.token_type = nn.Embedding(spec.type_vocab_size, spec.d_model)
        self.ln = nn.LayerNorm(spec.d_model, eps=spec.layer_norm_eps)
        self.drop = nn.Dropout(spec.dropout)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.size(1), device=input_ids.device)
        x = self.word(input_ids) + self.position(pos) + self.token_type(token_type_ids)
        return self.drop(self.ln(x))


class EncoderLayer(nn.Module):
    """Post-LayerNorm: x = LN(x + attn(x)); x = LN(x + ffn(x))."""

    def __init__(self, spec: ModelSpec, attention: AttentionImpl) -> None:
        super().__init__()
        self.attn = SelfAttention(spec.d_model, spec.n_head, spec.dropout, causal=False, attention=attention)
        self.ln_1 = nn.LayerNorm(spec.d_model, eps=spec.layer_norm_eps)
        self.mlp = MLP(spec.d_model, spec.d_ff, spec.dropout)
        self.ln_2 = nn.LayerNorm(spec.d_model, eps=spec.layer_norm_eps)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
        x = self.ln_1(x + self.attn(x, attn_mask))
        x = self.ln_2(x + self.mlp(x))
        return x


class MLMHead(nn.Module):
    """dense -> GELU -> LayerNorm -> decoder (weight tied to the word embeddings) + bias."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.dense = nn.Linear(spec.d_model, spec.d_model)
        self.ln = nn.LayerNorm(spec.d_model, eps=spec.layer_norm_eps)
        self.decoder = nn.Linear(spec.d_model, spec.vocab_size, bias=False)  # weight tied by BERT.tie_weights
        self.bias = nn.Parameter(torch.zeros(spec.vocab_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.ln(F.gelu(self.dense(x)))) + self.bias


class BERT(nn.Module):
    family = "bert"

    def __init__(self, spec: ModelSpec, attention: AttentionImpl = "explicit") -> None:
        super().__init__()
        if spec.family != "bert":
            raise ValueError(f"BERT needs a bert ModelSpec, got family {spec.family!r}")
        self.spec = spec
        self.attention = attention
        self.max_seq_len = spec.max_seq_len
        self.embeddings = Embeddings(spec)
        self.layers = nn.ModuleList(EncoderLayer(spec, attention) for _ in range(spec.n_layer))
        self.mlm = MLMHead(spec)
        # Tensor parallelism (graphtrain.distributed.tensor_parallel) swaps these for the vocab-parallel loss
        # and the gather of vocab-sharded logits.
        self.loss_fn, self.logits_fn = language_model_loss, identity
        self.reset_parameters()

    def tie_weights(self) -> None:
        """The MLM decoder shares the word embeddings (Module.to_empty() unties them; this re-ties)."""
        self.mlm.decoder.weight = self.embeddings.word.weight

    def reset_parameters(self) -> None:
        """BERT init: N(0, 0.02) weights, zero biases, LayerNorm (1, 0).

        Also the way to initialize after meta-device construction: ``model.to_empty(device=d)``
        then ``model.reset_parameters()``.
        """
        self.tie_weights()
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        nn.init.zeros_(self.mlm.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [B, T, V]; with labels, the mean MLM cross-entropy over positions whose label != -100.

        attention_mask [B, T]: 1 = attend, 0 = padding (default: all ones).
        token_type_ids [B, T]: segment ids (default: all zeros).
        """
        check_input_ids(input_ids)
        B, T = input_ids.shape
        check_seq_len(T, self.max_seq_len)
        for name, t in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids), ("labels", labels)):
            if t is not None and t.shape != input_ids.shape:
                raise ValueError(
                    f"{name} must have the shape of input_ids {tuple(input_ids.shape)}, got {tuple(t.shape)}"
                )
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.embeddings(input_ids, token_type_ids)
        mask = padding_mask(attention_mask, x.dtype) if attention_mask is not None else None
        for layer in self.layers:
            x = layer(x, mask)
        logits = self.mlm(x)
        if labels is None:
            return self.logits_fn(logits)
        return self.loss_fn(logits, labels)
