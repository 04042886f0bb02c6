"""GPT-2: a causal language model (pre-LayerNorm blocks, learned positions, tied LM head).

Same architecture and parameter count as Hugging Face's GPT2LMHeadModel, with one difference:
the MLP uses the exact (erf) GELU, where GPT-2 used the tanh approximation.

Labels arrive already shifted by the data loader: ``labels[:, t]`` is the target for position t.
"""

from __future__ import annotations

import math

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
)
from graphtrain.models.spec import ModelSpec


class Block(nn.Module):
    """x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, spec: ModelSpec, attention: AttentionImpl) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(spec.d_model, eps=spec.layer_norm_eps)
        self.attn = SelfAttention(spec.d_model, spec.n_head, spec.dropout, causal=True, attention=attention)
        self.ln_2 = nn.LayerNorm(spec.d_model, eps=spec.layer_norm_eps)
        self.mlp = MLP(spec.d_model, spec.d_ff, spec.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT2(nn.Module):
    family = "gpt2"

    def __init__(self, spec: ModelSpec, attention: AttentionImpl = "explicit") -> None:
        super().__init__()
        if spec.family != "gpt2":
            raise ValueError(f"GPT2 needs a gpt2 ModelSpec, got family {spec.family!r}")
        self.spec = spec
        self.attention = attention
        self.max_seq_len = spec.max_seq_len
        self.wte = nn.Embedding(spec.vocab_size, spec.d_model)
        self.wpe = nn.Embedding(spec.max_seq_len, spec.d_model)
        self.drop = nn.Dropout(spec.dropout)
        self.blocks = nn.ModuleList(Block(spec, attention) for _ in range(spec.n_layer))
        self.ln_f = nn.LayerNorm(spec.d_model, eps=spec.layer_norm_eps)
        self.lm_head = nn.Linear(spec.d_model, spec.vocab_size, bias=False)
        # Tensor parallelism (graphtrain.distributed.tensor_parallel) swaps these for the vocab-parallel loss
        # and the gather of vocab-sharded logits.
        self.loss_fn, self.logits_fn = language_model_loss, identity
        self.reset_parameters()

    def tie_weights(self) -> None:
        """One matrix embeds tokens and scores them (Module.to_empty() unties it; this re-ties)."""
        self.lm_head.weight = self.wte.weight

    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, 0.02) everywhere, residual output projections scaled by 1/sqrt(2 * n_layer).

        Also the way to initialize after meta-device construction: ``model.to_empty(device=d)``
        then ``model.reset_parameters()``.
        """
        self.tie_weights()
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        residual_std = 0.02 / math.sqrt(2 * self.spec.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.proj.weight, mean=0.0, std=residual_std)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, V] without labels; with labels [B, T], the mean cross-entropy (ignore -100)."""
        check_input_ids(input_ids)
        B, T = input_ids.shape
        check_seq_len(T, self.max_seq_len)
        pos = torch.arange(T, device=input_ids.device)
        x = self.drop(self.wte(input_ids) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if labels is None:
            return self.logits_fn(logits)
        if labels.shape != input_ids.shape:
            raise ValueError(
                f"labels must have the shape of input_ids {tuple(input_ids.shape)}, got {tuple(labels.shape)}"
            )
        return self.loss_fn(logits, labels)

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Sample `max_new_tokens` tokens after `input_ids` [B, T]; returns [B, T + max_new_tokens].

        The context is cropped to the last `max_seq_len` tokens. temperature 0 picks the argmax.
        Leaves the module's train/eval mode as it found it.
        """
        check_input_ids(input_ids)
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
        was_training = self.training
        self.eval()
        try:
            ids = input_ids.long()
            for _ in range(max_new_tokens):
                context = ids[:, -self.max_seq_len :]
                logits = self(context)[:, -1, :].float()
                if temperature == 0:
                    next_id = logits.argmax(dim=-1, keepdim=True)
                else:
                    logits = logits / temperature
                    if top_k is not None:
                        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                        logits = logits.masked_fill(logits < kth, float("-inf"))
                    probs = F.softmax(logits, dim=-1)
                    next_id = torch.multinomial(probs, num_samples=1, generator=generator)
                ids = torch.cat([ids, next_id], dim=1)
            return ids
        finally:
            self.train(was_training)
