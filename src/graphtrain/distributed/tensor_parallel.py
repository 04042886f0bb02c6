"""Megatron-style tensor parallelism on plain local tensors, parameters kept as DTensors.

Per transformer block (graphtrain's reference GPT-2 and BERT):

* attention: the fused `attn.qkv` Linear is split into three column-parallel Linears q, k, v
  (each rank owns n_head / tp whole heads); `attn.proj` is row-parallel. One all-reduce forward
  (after proj) and one backward (of the block input's gradient) per attention.
* MLP: `mlp.fc` column-parallel, `mlp.proj` row-parallel (again one all-reduce each way).
* vocabulary: the word embedding is vocab-parallel (each rank owns V / tp rows; ids outside the
  rank's range give zeros; the partial embeddings are all-reduced); the tied LM head / MLM decoder
  is column-parallel over the vocabulary and the cross-entropy is vocab-parallel
  (`vocab_parallel_cross_entropy`), so the [B, T, V] logits are never gathered for the loss.

How it is built, and why not with `torch.distributed.tensor.parallel`'s ColwiseParallel /
RowwiseParallel: those keep the linears' inputs and outputs as DTensors and put the collectives in
DTensor's autograd (`from_local`'s backward all-reduces). graphtrain's engine optimizes the forward
graph *before* autodiff on plain aten ops; tracing a DTensor program to plain ops keeps the forward
collectives and loses the backward ones. Here every activation is a plain tensor and the two
Megatron collectives are `torch.library` custom ops with their own autograd
(`graphtrain::tp_copy`: identity forward, all-reduce backward; `graphtrain::tp_reduce`:
all-reduce forward, identity backward), so a forward graph holds them as ordinary nodes that
AOTAutograd differentiates, and the engine's fusion passes see the local attention, GELU and
LayerNorm of every block. Parameters stay DTensors (Shard(0) column-parallel, Shard(1)
row-parallel weights): modules read `weight.to_local()`, whose backward hands the gradient back as
a DTensor, so optimizers, gradient clipping, FSDP2 `replicate` and DCP checkpoints see the usual
DTensor layout. The collectives themselves are torch.distributed's (`dist.all_reduce` /
`all_gather_into_tensor` on the tp group).

LayerNorms, position embeddings and the biases of row-parallel layers stay replicated plain
tensors: every tp rank computes the same values and the same gradients for them.

Dropout: every tp rank of a replica shares the default generator's state, so dropout on replicated
activations (embeddings, after each row-parallel all-reduce) drops the same elements on every rank.
Attention dropout runs on each rank's own heads and must not: `LocalHeadsRNG` gives it a stream per
tp rank in eager mode, and graphtrain::attention salts its seed with the tp rank in compiled graphs
(kernels/_common.py, `set_sharded_dropout_salt`). docs/design/distributed.md states the design.

The fused qkv is split into q/k/v because a contiguous column shard of [Wq; Wk; Wv] would mix
q, k and v. `checkpoint.py` re-fuses them (`FUSED_ATTR`) so checkpoints keep the unsharded
model's parameter names and shapes and load under any layout.

This module holds the collectives and the parallel layers; which layers of which model they replace (the
per-model plans, and `apply_tensor_parallel`) is distributed/tp_plans.py.
"""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from graphtrain.kernels._common import new_seed, salted_seed, set_sharded_dropout_salt
from graphtrain.kernels.registry import COLLECTIVE, FOLLOW, NEVER, OpDescriptor, no_workspace, register_ops

# model attribute: {fused fqn prefix ("blocks.0.attn.qkv"): [part prefixes (".q", ".k", ".v")]}
FUSED_ATTR = "_graphtrain_fused"
# model attribute: {fused fqn prefix: the dim its weight's q/k/v parts are stacked on} where it is not 0 (Hugging
# Face GPT-2's Conv1D keeps [in, out], so its fused c_attn stacks q, k, v along dim 1)
FUSED_DIM_ATTR = "_graphtrain_fused_weight_dim"


def _group(name: str) -> dist.ProcessGroup:
    return dist.distributed_c10d._resolve_process_group(name)


# Bytes this process has sent into tensor-parallel collectives, by op (graphtrain.bench.distributed reads it:
# the communication volume per step). One increment per call, on eager and compiled paths alike.
COMM_BYTES: collections.Counter = collections.Counter()


def _sent(op: str, x: torch.Tensor) -> None:
    COMM_BYTES[op] += x.numel() * x.element_size()


# --- the collectives, as custom ops with autograd -------------------------------------------------------
# Custom ops may not return an alias of an input, so tp_copy's identity forward is a copy (one
# activation-sized memcpy per attention / MLP, small beside their matmuls).


def _all_reduce(x: torch.Tensor, group: str, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    out = x.contiguous().clone()  # custom ops must not return (or write) their input
    _sent("all_reduce", out)
    dist.all_reduce(out, op=op, group=_group(group))
    return out


@torch.library.custom_op("graphtrain::tp_reduce", mutates_args=())
def tp_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """Sum over the tp group (forward); the gradient passes through unchanged (Megatron's g)."""
    return _all_reduce(x, group)


@torch.library.custom_op("graphtrain::tp_copy", mutates_args=())
def tp_copy(x: torch.Tensor, group: str) -> torch.Tensor:
    """Identity forward; the gradient is summed over the tp group (Megatron's f)."""
    return x.clone()


@torch.library.custom_op("graphtrain::tp_max", mutates_args=())
def tp_max(x: torch.Tensor, group: str) -> torch.Tensor:
    """Elementwise max over the tp group (no gradient: used for the softmax shift, a constant)."""
    return _all_reduce(x, group, dist.ReduceOp.MAX)


@torch.library.custom_op("graphtrain::tp_gather_last", mutates_args=())
def tp_gather_last(x: torch.Tensor, group: str) -> torch.Tensor:
    """Concatenate the ranks' tensors along the last dim (forward); backward keeps this rank's slice."""
    g = _group(group)
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(dist.get_world_size(g))]
    _sent("all_gather", x)
    dist.all_gather(parts, x.contiguous(), group=g)
    return torch.cat(parts, dim=-1)


for _op in (tp_reduce, tp_copy, tp_max):
    _op.register_fake(lambda x, group: torch.empty_like(x))


@tp_gather_last.register_fake
def _(x: torch.Tensor, group: str) -> torch.Tensor:
    n = dist.get_world_size(_group(group))
    return x.new_empty(*x.shape[:-1], n * x.shape[-1])


# Never recomputed (a re-run would add communication); dtype follows the input.
register_ops(
    *(
        OpDescriptor(
            name, role=COLLECTIVE, random=False, recompute=NEVER, precision=FOLLOW, workspace_bytes=no_workspace, cpp=()
        )
        for name in ("tp_reduce", "tp_copy", "tp_max", "tp_gather_last")
    ),
    owner=__name__,
)


def _save_group(ctx, inputs, output) -> None:
    ctx.group = inputs[1]


tp_reduce.register_autograd(lambda ctx, g: (g, None), setup_context=_save_group)
tp_copy.register_autograd(lambda ctx, g: (tp_reduce(g, ctx.group), None), setup_context=_save_group)
# The softmax shift is a constant: no gradient. Its input is detached, but torch 2.14's AOTAutograd traces a backward
# through every op of a graph that has inputs needing gradients, and raised "no autograd formula was registered".
tp_max.register_autograd(lambda ctx, g: (None, None), setup_context=_save_group)


def _gather_backward(ctx, g):
    grp = _group(ctx.group)
    n, r = dist.get_world_size(grp), dist.get_rank(grp)
    return g.chunk(n, dim=-1)[r].contiguous(), None


tp_gather_last.register_autograd(_gather_backward, setup_context=_save_group)


# --- dropout on this rank's heads ------------------------------------------------------------------


class LocalHeadsRNG:
    """Eager attention dropout on this tp rank's heads, drawn from a random stream of the rank's own.

    Every tp rank of a replica runs from the same default-generator state (dropout on replicated activations
    must agree across tp ranks), so attention dropout on the ranks' equally shaped local heads would draw
    the same masks. `enter` (a forward pre-hook where the attention core starts) draws one seed from the
    default generator -- the same draw on every tp rank, so the shared stream stays aligned -- and reseeds
    the generators with it salted by the tp rank (`salted_seed`, as graphtrain::attention does); `exit`
    (where the core ends) restores the default generator to its state after that draw. The stream is
    therefore a function of the default generator's state: checkpoints, which save that state, need
    nothing more, and a resumed run draws the same masks. Under torch.compile both hooks do nothing: the
    engine fuses the attention into graphtrain::attention, which salts its own seed. Skipped in eval and
    at p = 0, so a run without dropout draws exactly what it did before."""

    def __init__(self, salt: int, device_type: str, p_of) -> None:
        self.salt, self.p_of = salt, p_of  # p_of(attention module) -> its attention-dropout probability
        self.cuda = [torch.cuda.current_device()] if device_type == "cuda" else []  # this rank's GPU
        self._fork = None

    def enter(self, module: nn.Module, args: tuple) -> None:
        if torch.compiler.is_compiling() or not module.training or self.p_of(module) == 0:
            return
        self.exit()  # a forward that raised inside the region left it open
        seed = salted_seed(int(new_seed().item()), self.salt)
        self._fork = torch.random.fork_rng(devices=self.cuda, device_type="cuda")
        self._fork.__enter__()
        torch.default_generator.manual_seed(seed)
        for index in self.cuda:
            torch.cuda.default_generators[index].manual_seed(seed)

    def exit(self, *_: object) -> None:
        if torch.compiler.is_compiling() or self._fork is None:
            return
        fork, self._fork = self._fork, None
        fork.__exit__(None, None, None)


def _attention_dropout_on_local_heads(
    tp_mesh: DeviceMesh, regions: list[tuple[nn.Module, nn.Module, bool]], p_of
) -> None:
    """Salt this rank's attention dropout: the fused op (process-wide) and, for eager, `LocalHeadsRNG` over each
    (module where the core starts, module at whose entry (True) or exit (False) it ends) in `regions`."""
    salt = tp_mesh.get_local_rank()
    set_sharded_dropout_salt(salt)
    rng = LocalHeadsRNG(salt, tp_mesh.device_type, p_of)
    for start, end, at_entry in regions:
        start.register_forward_pre_hook(rng.enter)
        if at_entry:
            end.register_forward_pre_hook(rng.exit)
        else:
            end.register_forward_hook(rng.exit)


# --- the parallel layers ----------------------------------------------------------------------------


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.to_local() if isinstance(t, DTensor) else t


def _shard_param(p: torch.Tensor, mesh: DeviceMesh, dim: int) -> nn.Parameter:
    """This rank's chunk of `p` along `dim` (a copy: the full tensor can be freed), as a Shard(dim) DTensor."""
    local = p.detach().chunk(mesh.size(), dim=dim)[mesh.get_local_rank()].clone()
    return nn.Parameter(DTensor.from_local(local, mesh, [Shard(dim)], run_check=False), requires_grad=p.requires_grad)


def _vocab_range(vocab_size: int, mesh: DeviceMesh) -> tuple[int, int]:
    """[start, end) of the vocabulary rows this tp rank holds."""
    rows = vocab_size // mesh.size()
    return mesh.get_local_rank() * rows, (mesh.get_local_rank() + 1) * rows


class ColumnParallelLinear(nn.Module):
    """y_local = x @ W_local^T + b_local, W sharded on the output dim. `copy_input`: put tp_copy on x
    (off when the caller already did, as SplitQKV does once for q, k and v). `gather_output`: all-gather
    y along its last dim (for a head whose model computes the loss itself, e.g. Hugging Face's)."""

    def __init__(
        self,
        linear: nn.Linear,
        mesh: DeviceMesh,
        copy_input: bool = True,
        gather_output: bool = False,
        rows: slice = slice(None),
    ) -> None:
        """`rows`: shard only these output rows of `linear` (one of q, k, v of a fused projection)."""
        super().__init__()
        self.group, self.copy_input, self.gather_output = mesh.get_group().group_name, copy_input, gather_output
        self.weight = _shard_param(linear.weight[rows], mesh, 0)
        self.bias = _shard_param(linear.bias[rows], mesh, 0) if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            x = tp_copy(x, self.group)
        y = F.linear(x, self.weight.to_local(), _local(self.bias))
        return tp_gather_last(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """y = allreduce(x_local @ W_local^T) + b, W sharded on the input dim, b replicated."""

    def __init__(self, linear: nn.Linear, mesh: DeviceMesh) -> None:
        super().__init__()
        self.group = mesh.get_group().group_name
        self.weight = _shard_param(linear.weight, mesh, 1)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = tp_reduce(F.linear(x, self.weight.to_local()), self.group)
        return y if self.bias is None else y + self.bias


class SplitQKV(nn.Module):
    """q, k, v as three column-parallel Linears; output [q_local | k_local | v_local] (this rank's heads)."""

    def __init__(self, fused: nn.Linear, mesh: DeviceMesh) -> None:
        super().__init__()
        self.group = mesh.get_group().group_name
        d = fused.out_features // 3
        self.q, self.k, self.v = (
            ColumnParallelLinear(fused, mesh, copy_input=False, rows=slice(i * d, (i + 1) * d)) for i in range(3)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = tp_copy(x, self.group)
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)


class ColumnParallelConv1D(nn.Module):
    """Hugging Face's Conv1D (y = x @ W + b, W [in, out]) column-parallel: W sharded on dim 1 (its output), the
    layout kept so checkpoints hold the unsharded model's tensors. `cols`: shard only these output columns."""

    def __init__(self, conv: nn.Module, mesh: DeviceMesh, copy_input: bool = True, cols: slice = slice(None)) -> None:
        super().__init__()
        self.group, self.copy_input = mesh.get_group().group_name, copy_input
        self.weight = _shard_param(conv.weight[:, cols], mesh, 1)
        self.bias = _shard_param(conv.bias[cols], mesh, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            x = tp_copy(x, self.group)
        return torch.addmm(_local(self.bias), x.reshape(-1, x.size(-1)), self.weight.to_local()).view(*x.shape[:-1], -1)


class RowParallelConv1D(nn.Module):
    """Conv1D row-parallel: W [in, out] sharded on dim 0 (its input), the partial products all-reduced, b replicated."""

    def __init__(self, conv: nn.Module, mesh: DeviceMesh) -> None:
        super().__init__()
        self.group = mesh.get_group().group_name
        self.weight = _shard_param(conv.weight, mesh, 0)
        self.bias = conv.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tp_reduce(x @ self.weight.to_local(), self.group) + self.bias


class SplitQKVConv1D(nn.Module):
    """GPT-2's fused Conv1D c_attn as three column-parallel parts; output [q_local | k_local | v_local]."""

    def __init__(self, conv: nn.Module, mesh: DeviceMesh) -> None:
        super().__init__()
        self.group = mesh.get_group().group_name
        d = conv.weight.shape[1] // 3
        self.q, self.k, self.v = (
            ColumnParallelConv1D(conv, mesh, copy_input=False, cols=slice(i * d, (i + 1) * d)) for i in range(3)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = tp_copy(x, self.group)
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)


class VocabParallelEmbedding(nn.Module):
    """Each rank embeds the ids in its V / tp rows (others give zeros); the partial sums are all-reduced."""

    def __init__(self, emb: nn.Embedding, mesh: DeviceMesh) -> None:
        super().__init__()
        self.group = mesh.get_group().group_name
        self.weight = _shard_param(emb.weight, mesh, 0)
        self.start, self.end = _vocab_range(emb.num_embeddings, mesh)
        pad = emb.padding_idx  # its row gets no gradient, on the rank that holds it
        self.padding_idx = pad - self.start if pad is not None and self.start <= pad < self.end else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        e = F.embedding(local, self.weight.to_local(), self.padding_idx).masked_fill(outside.unsqueeze(-1), 0.0)
        return tp_reduce(e, self.group)


class VocabParallelMLMHead(nn.Module):
    """BERT's MLM head with the tied decoder column-parallel over the vocabulary and its bias sharded alike."""

    def __init__(self, head: nn.Module, mesh: DeviceMesh) -> None:
        super().__init__()
        self.dense, self.ln = head.dense, head.ln
        self.decoder = ColumnParallelLinear(head.decoder, mesh)
        self.bias = _shard_param(head.bias, mesh, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.ln(F.gelu(self.dense(x)))) + self.bias.to_local()


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, *, group: str, start: int, ignore_index: int = -100
) -> torch.Tensor:
    """Mean cross-entropy over labels != ignore_index, from vocab-sharded logits [..., V / tp] (Megatron's
    vocab-parallel loss): the max, the sum of exponentials and the target logit are reduced over the tp
    group instead of gathering the logits."""
    logits = logits.float().reshape(-1, logits.size(-1))
    labels = labels.reshape(-1)
    shift = tp_max(logits.detach().amax(dim=-1), group)
    z = logits - shift.unsqueeze(-1)
    sum_exp = tp_reduce(z.exp().sum(dim=-1), group)
    local = labels - start
    mine = (local >= 0) & (local < logits.size(-1))
    picked = z.gather(-1, local.clamp(0, logits.size(-1) - 1).unsqueeze(-1)).squeeze(-1)
    target = tp_reduce(torch.where(mine, picked, torch.zeros_like(picked)), group)
    valid = labels != ignore_index
    per_token = torch.where(valid, sum_exp.log() - target, torch.zeros_like(target))
    return per_token.sum() / valid.sum()


def split_mixed_param_groups(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Split every param group holding both DTensors (sharded) and plain tensors (replicated) in two.

    Foreach/fused optimizer kernels refuse a mix of torch.Tensor and DTensor in one call; the two
    halves keep the group's hyper-parameters. Must run before the first step (no state yet).
    """
    groups = []
    for g in optimizer.param_groups:
        sharded = [p for p in g["params"] if isinstance(p, DTensor)]
        plain = [p for p in g["params"] if not isinstance(p, DTensor)]
        groups += [{**g, "params": ps} for ps in (sharded, plain) if ps]
    optimizer.param_groups[:] = groups
    return optimizer
