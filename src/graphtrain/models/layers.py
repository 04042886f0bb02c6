"""Layers shared by GPT-2 and BERT: multi-head self-attention and the feed-forward MLP.

Attention is written the way users commonly write it, on purpose: graphtrain's passes must find
the real pattern (matmul, scale, mask, softmax, dropout, matmul) in captured graphs. With
``attention="sdpa"`` the same layer calls ``F.scaled_dot_product_attention`` instead; both give
the same result with dropout off (tests/test_models.py).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

AttentionImpl = Literal["explicit", "sdpa"]


def check_attention_impl(attention: str) -> None:
    if attention not in ("explicit", "sdpa"):
        raise ValueError(f"attention must be 'explicit' or 'sdpa' (model.attention), got {attention!r}")


class SelfAttention(nn.Module):
    """Multi-head self-attention with a fused QKV projection.

    `causal=True` (GPT-2) masks future positions; otherwise an optional additive mask of shape
    [B, 1, 1, T] (BERT padding: 0 keep, large negative drop) is added to the scores.
    """

    def __init__(
        self, d_model: int, n_head: int, dropout: float, *, causal: bool, attention: AttentionImpl = "explicit"
    ) -> None:
        super().__init__()
        check_attention_impl(attention)
        assert d_model % n_head == 0
        self.n_head = n_head
        self.head_dim = d_model // n_head
        self.causal = causal
        self.attention = attention
        self.dropout_p = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=2)
        # Heads from the projection's width: all of them, or a tensor-parallel rank's share
        # (graphtrain.distributed.tensor_parallel shards qkv column-wise as [q_local | k_local | v_local]).
        n_head, width = q.shape[-1] // self.head_dim, q.shape[-1]
        # [B, T, width] -> [B, n_head, T, head_dim]
        q = q.view(B, T, n_head, self.head_dim).transpose(1, 2)
        k = k.view(B, T, n_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, n_head, self.head_dim).transpose(1, 2)

        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=attn_mask,
                is_causal=self.causal and attn_mask is None,
                dropout_p=self.dropout_p if self.training else 0.0,
            )
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
            if self.causal:
                # True above the diagonal = a future position. Built per call rather than kept as a
                # buffer, so meta-device construction + to_empty() cannot leave it uninitialized.
                future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
                att = att.masked_fill(future, float("-inf"))
            if attn_mask is not None:
                att = att + attn_mask
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v

        y = y.transpose(1, 2).contiguous().view(B, T, width)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: Linear, GELU (erf form), Linear, dropout."""

    def __init__(self, d_model: int, d_ff: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, d_ff)
        self.proj = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


def padding_mask(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, T] with 1 = keep, 0 = padding  ->  additive [B, 1, 1, T]: 0 keep, dtype's minimum drop."""
    if attention_mask.dim() != 2:
        raise ValueError(
            f"attention_mask must be [batch, seq] with 1 = keep and 0 = padding, "
            f"got shape {tuple(attention_mask.shape)}"
        )
    keep = attention_mask[:, None, None, :].to(dtype)
    return (1.0 - keep) * torch.finfo(dtype).min


def check_seq_len(T: int, max_seq_len: int) -> None:
    if T > max_seq_len:
        raise ValueError(
            f"input sequence length {T} exceeds the model's max_seq_len {max_seq_len}: "
            f"set model.max_seq_len >= {T} or lower data.seq_len to <= {max_seq_len}"
        )


def check_input_ids(input_ids: torch.Tensor) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a [batch, seq] tensor of token ids, got {shape}")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"input_ids must hold integer token ids (torch.long), got {input_ids.dtype}")


def language_model_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over positions whose label is not -100 (labels are already aligned)."""
    return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100)


def identity(x: torch.Tensor) -> torch.Tensor:
    return x
