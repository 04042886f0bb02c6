"""Megatron-style tensor parallelism with DTensor (`torch.distributed.tensor.parallel`).

Per transformer block (graphtrain's reference GPT-2 and BERT):

* attention: the fused `attn.qkv` Linear is split into three Linears q, k, v, each
  `ColwiseParallel` (so each rank owns n_head / tp whole heads); `attn.proj` is `RowwiseParallel`
  (its output all-reduced). One all-reduce forward and one backward per attention.
* MLP: `mlp.fc` `ColwiseParallel`, `mlp.proj` `RowwiseParallel` (again one all-reduce each way).
* vocabulary: the word embedding is `RowwiseParallel` (vocab-parallel: each rank owns V / tp rows,
  out-of-range ids give zeros, the partial embeddings are all-reduced); the tied LM head is
  `ColwiseParallel` with logits left sharded on the vocab dim, and GPT-2's cross-entropy runs
  under `loss_parallel()`, so the [B, T, V] logits are never gathered. BERT's MLM decoder adds a
  bias after the tied matmul, so its logits are gathered (Replicate) before the loss.

LayerNorms, position embeddings and biases of row-parallel layers stay replicated plain tensors:
every tp rank computes the same values and the same gradients for them.

The fused qkv is split into q/k/v because a contiguous column shard of [Wq; Wk; Wv] would mix
q, k and v. `checkpoint.py` re-fuses them (`FUSED_ATTR`) so checkpoints keep the unsharded
model's parameter names and shapes and load under any layout.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, loss_parallel,
                                               parallelize_module)

# model attribute: {fused fqn prefix ("blocks.0.attn.qkv"): [part prefixes (".q", ".k", ".v")]}
FUSED_ATTR = "_graphtrain_fused"


class SplitQKV(nn.Module):
    """q, k, v as three Linears; output [q_local | k_local | v_local] (each tp rank's heads)."""

    def __init__(self, fused: nn.Linear) -> None:
        super().__init__()
        d_in, d_out = fused.in_features, fused.out_features // 3
        bias = fused.bias is not None
        self.q, self.k, self.v = (nn.Linear(d_in, d_out, bias=bias) for _ in range(3))
        with torch.no_grad():
            for i, lin in enumerate((self.q, self.k, self.v)):
                lin.weight.copy_(fused.weight[i * d_out:(i + 1) * d_out])
                if bias:
                    lin.bias.copy_(fused.bias[i * d_out:(i + 1) * d_out])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)


def _blocks_and_vocab(model: nn.Module) -> tuple[str, nn.ModuleList, str, str, bool]:
    """(blocks attr, blocks, embedding fqn, head fqn, loss_parallel ok) for graphtrain's reference models."""
    family = getattr(model, "family", None)
    if family == "gpt2":
        return "blocks", model.blocks, "wte", "lm_head", True
    if family == "bert":
        return "layers", model.layers, "embeddings.word", "mlm.decoder", False
    raise ValueError(
        f"tensor parallelism has a plan for graphtrain's reference GPT-2 and BERT (graphtrain.models), "
        f"not for {type(model).__name__}. Hugging Face GPT-2 fuses q/k/v in one Conv1D (c_attn) and has "
        f"no plan; use parallel.tp=1 (data/pipeline parallel work with any model) or a graphtrain model")


def check_tp(model: nn.Module, tp: int) -> None:
    """Raise ValueError unless heads, hidden sizes and the vocabulary divide by tp."""
    spec = model.spec
    for what, n in (("attention heads (n_head)", spec.n_head), ("MLP width (d_ff)", spec.d_ff),
                    ("vocabulary (vocab_size)", spec.vocab_size)):
        if n % tp:
            fix = [d for d in range(tp, 0, -1) if n % d == 0][0]
            raise ValueError(f"parallel.tp={tp} must divide the model's {what} = {n}: use parallel.tp={fix}"
                             + (" or pad the vocabulary (model.vocab_size) to a multiple of tp"
                                if "vocab" in what else ""))


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Shard `model` in place over the 1-D `tp_mesh`; returns it. Weights must already be identical on all tp ranks."""
    tp = tp_mesh.size()
    if tp == 1:
        return model
    _, blocks, emb_fqn, head_fqn, vocab_loss = _blocks_and_vocab(model)
    check_tp(model, tp)
    prefix = "blocks" if model.family == "gpt2" else "layers"
    fused: dict[str, list[str]] = {}
    for i, block in enumerate(blocks):
        attn = block.attn
        attn.qkv = SplitQKV(attn.qkv)
        fused[f"{prefix}.{i}.attn.qkv"] = [".q", ".k", ".v"]
        parallelize_module(block, tp_mesh, {
            "attn.qkv.q": ColwiseParallel(), "attn.qkv.k": ColwiseParallel(), "attn.qkv.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(),
            "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel(),
        })
    head_style = (ColwiseParallel(output_layouts=Shard(-1), use_local_output=False) if vocab_loss
                  else ColwiseParallel(output_layouts=Replicate()))
    parallelize_module(model, tp_mesh, {emb_fqn: RowwiseParallel(input_layouts=Replicate()), head_fqn: head_style})
    # parallelize_module replaced each module's Parameter: re-tie the head to the (sharded) embedding.
    emb, head = model.get_submodule(emb_fqn), model.get_submodule(head_fqn)
    head.weight = emb.weight
    setattr(model, FUSED_ATTR, fused)
    model._graphtrain_loss_parallel = vocab_loss
    return model


def loss_context(model: nn.Module) -> contextlib.AbstractContextManager:
    """Wrap forward *and* backward in this: `loss_parallel()` when the logits are vocab-sharded."""
    inner = getattr(model, "module", model)
    return loss_parallel() if getattr(inner, "_graphtrain_loss_parallel", False) else contextlib.nullcontext()


def local_loss(loss: torch.Tensor) -> torch.Tensor:
    """A DTensor loss (replicated) as a plain tensor, for logging."""
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss


def split_mixed_param_groups(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Split every param group holding both DTensors (sharded) and plain tensors (replicated) in two.

    Foreach/fused optimizer kernels refuse a mix of torch.Tensor and DTensor in one call; the two
    halves keep the group's hyper-parameters. Must run before the first step (no state yet).
    """
    from torch.distributed.tensor import DTensor
    groups = []
    for g in optimizer.param_groups:
        sharded = [p for p in g["params"] if isinstance(p, DTensor)]
        plain = [p for p in g["params"] if not isinstance(p, DTensor)]
        groups += [{**g, "params": ps} for ps in (sharded, plain) if ps]
    optimizer.param_groups[:] = groups
    return optimizer
