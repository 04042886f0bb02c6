"""Tensor-parallel plans: which layers of which model become column-, row- and vocab-parallel.

The parallel layers and the collectives are distributed/tensor_parallel.py's; a plan swaps a model's own layers
for them. `apply_tensor_parallel` finds the model's plan by what the model is, never by its class's name:

* graphtrain's reference models by class: ``models.gpt2.GPT2`` and its pipeline stages
  (``distributed.pipeline.GPT2Stage``) take the GPT-2 plan, ``models.bert.BERT`` the BERT plan;
* a Hugging Face model (alone, or inside graphtrain's ``model.hf`` wrapper ``models.hf.HFLanguageModel``) by its
  config's ``model_type`` together with the model class the plan is written for (``isinstance``, so subclasses
  qualify): bert with ``BertForMaskedLM``, gpt2 with ``GPT2LMHeadModel``, and the Llama layer layout (q/k/v/o
  projections, gate/up/down MLP) for llama, mistral, qwen2 and qwen3 with their ``*ForCausalLM``.

Anything else has no plan: `check_tp` says so, naming what does (data parallelism works with any model).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from graphtrain.distributed.pipeline import GPT2Stage
from graphtrain.distributed.tensor_parallel import (
    FUSED_ATTR,
    FUSED_DIM_ATTR,
    ColumnParallelConv1D,
    ColumnParallelLinear,
    RowParallelConv1D,
    RowParallelLinear,
    SplitQKV,
    SplitQKVConv1D,
    VocabParallelEmbedding,
    VocabParallelMLMHead,
    _attention_dropout_on_local_heads,
    _vocab_range,
    tp_copy,
    tp_gather_last,
    vocab_parallel_cross_entropy,
)
from graphtrain.models.bert import BERT
from graphtrain.models.gpt2 import GPT2
from graphtrain.models.hf import HFLanguageModel


@dataclass(frozen=True)
class TPPlan:
    """How one kind of model is sharded: the sizes tp must divide, and the function that shards it in place."""

    name: str
    sizes: Callable[[nn.Module], tuple[int, int, int, int | None]]  # heads, MLP width, vocabulary, key/value heads
    apply: Callable[[nn.Module, DeviceMesh], nn.Module]


def _set(model: nn.Module, fqn: str, module: nn.Module) -> None:
    parent, _, name = fqn.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)


def _has(model: nn.Module, fqn: str) -> bool:
    try:
        model.get_submodule(fqn)
    except AttributeError:
        return False
    return True


def _copy_first_input(group: str):
    """A forward pre-hook putting tp_copy on a module's hidden_states (positional or keyword)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (tp_copy(args[0], group),) + tuple(args[1:]), kwargs
        return args, {**kwargs, "hidden_states": tp_copy(kwargs["hidden_states"], group)}

    return hook


# --- graphtrain's reference models -----------------------------------------------------------------


def _apply_reference(model: nn.Module, tp_mesh: DeviceMesh, gpt2: bool) -> nn.Module:
    """The Megatron plan on graphtrain's GPT-2 (or one of its pipeline stages: its blocks, plus the embedding on the
    first stage and the LM head on the last) and BERT: fused qkv split into column-parallel q/k/v, the attention and
    MLP output projections row-parallel, the word embedding vocab-parallel, the tied head column-parallel and the
    cross-entropy vocab-parallel (the [B, T, V] logits are never gathered for the loss)."""
    prefix, blocks = ("blocks", model.blocks) if gpt2 else ("layers", model.layers)
    fused: dict[str, list[str]] = {}
    regions = []
    for i, block in blocks.items() if isinstance(blocks, nn.ModuleDict) else enumerate(blocks):
        block.attn.qkv = SplitQKV(block.attn.qkv, tp_mesh)
        fused[f"{prefix}.{i}.attn.qkv"] = [".q", ".k", ".v"]
        block.attn.proj = RowParallelLinear(block.attn.proj, tp_mesh)
        block.mlp.fc = ColumnParallelLinear(block.mlp.fc, tp_mesh)
        block.mlp.proj = RowParallelLinear(block.mlp.proj, tp_mesh)
        # SelfAttention's local-head part (explicit softmax-dropout or SDPA) runs between its entry and its
        # row-parallel output projection; the residual dropout after that is on replicated activations.
        regions.append((block.attn, block.attn.proj, True))
    _attention_dropout_on_local_heads(tp_mesh, regions, lambda attn: attn.dropout_p)
    emb_fqn = "wte" if gpt2 else "embeddings.word"
    emb = None
    if _has(model, emb_fqn):  # a pipeline stage other than the first has none
        emb = VocabParallelEmbedding(model.get_submodule(emb_fqn), tp_mesh)
        _set(model, emb_fqn, emb)
    if gpt2 and hasattr(model, "lm_head"):  # the last stage's head is its own copy of the tied matrix
        model.lm_head = ColumnParallelLinear(model.lm_head, tp_mesh)
        if emb is not None:
            model.lm_head.weight = emb.weight  # the tied matrix, one sharded Parameter
    elif not gpt2:
        model.mlm = VocabParallelMLMHead(model.mlm, tp_mesh)
        model.mlm.decoder.weight = emb.weight
    group = tp_mesh.get_group().group_name
    start, _ = _vocab_range(model.spec.vocab_size, tp_mesh)  # also on a pipeline stage without the embedding
    model.loss_fn = functools.partial(vocab_parallel_cross_entropy, group=group, start=start)
    model.logits_fn = functools.partial(tp_gather_last, group=group)  # full logits when asked without labels
    setattr(model, FUSED_ATTR, fused)
    return model


def _reference_sizes(model: nn.Module) -> tuple[int, int, int, None]:
    return model.spec.n_head, model.spec.d_ff, model.spec.vocab_size, None


REFERENCE_GPT2 = TPPlan("graphtrain GPT-2", _reference_sizes, functools.partial(_apply_reference, gpt2=True))
REFERENCE_BERT = TPPlan("graphtrain BERT", _reference_sizes, functools.partial(_apply_reference, gpt2=False))


# --- Hugging Face models ---------------------------------------------------------------------------


def _apply_hf_bert(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """The Megatron plan on Hugging Face BertForMaskedLM (separate query/key/value Linears, heads reshaped with
    -1, so each rank's attention runs on its n_head / tp heads unchanged). The word embedding is vocab-parallel;
    the tied decoder is column-parallel over the vocabulary with its output gathered, because the model computes
    its own cross-entropy on [B, T, V] logits."""
    group = tp_mesh.get_group().group_name
    regions = []
    for layer in model.bert.encoder.layer:
        sa = layer.attention.self
        for name in ("query", "key", "value"):
            setattr(sa, name, ColumnParallelLinear(getattr(sa, name), tp_mesh, copy_input=False))
        sa.register_forward_pre_hook(_copy_first_input(group), with_kwargs=True)  # one backward all-reduce for q, k, v
        regions.append((sa, sa, False))  # BertSelfAttention holds only local-head work (its output dense is apart)
        layer.attention.output.dense = RowParallelLinear(layer.attention.output.dense, tp_mesh)
        layer.intermediate.dense = ColumnParallelLinear(layer.intermediate.dense, tp_mesh)
        layer.output.dense = RowParallelLinear(layer.output.dense, tp_mesh)
    _attention_dropout_on_local_heads(tp_mesh, regions, lambda sa: sa.dropout.p)
    emb = VocabParallelEmbedding(model.bert.embeddings.word_embeddings, tp_mesh)
    model.bert.embeddings.word_embeddings = emb
    head = model.cls.predictions
    head.decoder = ColumnParallelLinear(head.decoder, tp_mesh, gather_output=True)
    head.decoder.weight = emb.weight
    head.bias = head.decoder.bias  # Hugging Face ties the two
    return model


def _apply_hf_gpt2(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """The Megatron plan on Hugging Face GPT2LMHeadModel, in its Conv1D layout ([in, out] weights): c_attn split into
    column-parallel q/k/v (each attention then runs on its n_head / tp local heads: HF reshapes heads with -1 and
    splits c_attn's output by `split_size`, set to the local width), c_fc column-parallel, both c_proj
    row-parallel, the word embedding vocab-parallel and the tied LM head column-parallel with its logits
    gathered (the model, or graphtrain's model.hf wrapper, computes its own cross-entropy on [B, T, V])."""
    tp = tp_mesh.size()
    fused, dims, regions = {}, {}, []
    for i, block in enumerate(model.transformer.h):
        attn = block.attn
        if getattr(attn, "is_cross_attention", False) or getattr(attn, "reorder_and_upcast_attn", False):
            raise ValueError(
                "tensor parallel on Hugging Face GPT-2 supports self-attention without "
                "reorder_and_upcast_attn; use parallel.tp=1 for this config"
            )
        attn.c_attn = SplitQKVConv1D(attn.c_attn, tp_mesh)
        attn.split_size = attn.embed_dim // tp
        fused[f"transformer.h.{i}.attn.c_attn"] = [".q", ".k", ".v"]
        dims[f"transformer.h.{i}.attn.c_attn"] = 1
        attn.c_proj = RowParallelConv1D(attn.c_proj, tp_mesh)
        block.mlp.c_fc = ColumnParallelConv1D(block.mlp.c_fc, tp_mesh)
        block.mlp.c_proj = RowParallelConv1D(block.mlp.c_proj, tp_mesh)
        regions.append((attn, attn.c_proj, True))  # local-head work runs from attn's entry to c_proj's
    _attention_dropout_on_local_heads(tp_mesh, regions, lambda attn: attn.attn_dropout.p)
    emb = VocabParallelEmbedding(model.transformer.wte, tp_mesh)
    model.transformer.wte = emb
    model.lm_head = ColumnParallelLinear(model.lm_head, tp_mesh, gather_output=True)
    if model.config.tie_word_embeddings:
        model.lm_head.weight = emb.weight
    setattr(model, FUSED_ATTR, fused)
    setattr(model, FUSED_DIM_ATTR, dims)
    return model


def _apply_llama_family(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """The Megatron plan on a Llama-family causal LM: q/k/v and gate/up column-parallel (one tp_copy for each
    group's shared input), o and down row-parallel; grouped-query attention keeps its heads-per-key/value ratio on
    each rank's n_head / tp query and n_kv / tp key/value heads (HF reshapes heads with -1). Embedding
    vocab-parallel; the LM head column-parallel with its logits gathered (tied to the embedding when the config
    ties them)."""
    group = tp_mesh.get_group().group_name
    regions = []
    for layer in model.model.layers:
        sa, mlp = layer.self_attn, layer.mlp
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(sa, name, ColumnParallelLinear(getattr(sa, name), tp_mesh, copy_input=False))
        sa.register_forward_pre_hook(_copy_first_input(group), with_kwargs=True)
        sa.o_proj = RowParallelLinear(sa.o_proj, tp_mesh)
        regions.append((sa, sa.o_proj, True))
        for name in ("gate_proj", "up_proj"):
            setattr(mlp, name, ColumnParallelLinear(getattr(mlp, name), tp_mesh, copy_input=False))
        mlp.register_forward_pre_hook(_copy_first_input(group), with_kwargs=True)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, tp_mesh)
    _attention_dropout_on_local_heads(tp_mesh, regions, lambda sa: float(getattr(sa, "attention_dropout", 0.0)))
    emb = VocabParallelEmbedding(model.model.embed_tokens, tp_mesh)
    model.model.embed_tokens = emb
    model.lm_head = ColumnParallelLinear(model.lm_head, tp_mesh, gather_output=True)
    if model.config.tie_word_embeddings:
        model.lm_head.weight = emb.weight
    return model


HF_BERT = TPPlan(
    "Hugging Face BertForMaskedLM",
    lambda m: (m.config.num_attention_heads, m.config.intermediate_size, m.config.vocab_size, None),
    _apply_hf_bert,
)
HF_GPT2 = TPPlan(
    "Hugging Face GPT2LMHeadModel",
    lambda m: (m.config.n_head, m.config.n_inner or 4 * m.config.n_embd, m.config.vocab_size, None),
    _apply_hf_gpt2,
)
HF_LLAMA = TPPlan(
    "Hugging Face Llama-family causal LM",
    lambda m: (
        m.config.num_attention_heads,
        m.config.intermediate_size,
        m.config.vocab_size,
        m.config.num_key_value_heads,
    ),
    _apply_llama_family,
)


def _hf_plans(transformers) -> dict[str, tuple[type, TPPlan]]:
    """config.model_type -> (the transformers class the plan is written for, the plan). Families this
    transformers release does not have are left out."""
    plans = {
        "bert": (transformers.BertForMaskedLM, HF_BERT),
        "gpt2": (transformers.GPT2LMHeadModel, HF_GPT2),
        "llama": (transformers.LlamaForCausalLM, HF_LLAMA),
    }
    for model_type, cls in (
        ("mistral", "MistralForCausalLM"),
        ("qwen2", "Qwen2ForCausalLM"),
        ("qwen3", "Qwen3ForCausalLM"),
    ):
        try:
            plans[model_type] = (getattr(transformers, cls), HF_LLAMA)
        except (AttributeError, ImportError):  # an older transformers without this family
            continue
    return plans


# --- finding a model's plan ------------------------------------------------------------------------


def plan_of(model: nn.Module) -> tuple[nn.Module, TPPlan]:
    """(the module the plan shards, the plan) for `model`; for graphtrain's model.hf wrapper the module is the
    transformers model inside it. ValueError when the model has no plan."""
    if isinstance(model, (GPT2, GPT2Stage)):
        return model, REFERENCE_GPT2
    if isinstance(model, BERT):
        return model, REFERENCE_BERT
    inner = model.hf if isinstance(model, HFLanguageModel) else model
    transformers = sys.modules.get("transformers")  # a transformers model means transformers is imported
    model_type = getattr(getattr(inner, "config", None), "model_type", None)
    if transformers is not None and isinstance(model_type, str):
        cls, plan = _hf_plans(transformers).get(model_type, (None, None))
        if cls is not None and isinstance(inner, cls):
            return inner, plan
    raise ValueError(
        f"tensor parallelism has a plan for graphtrain's reference GPT-2 and BERT (graphtrain.models) and Hugging "
        f"Face GPT2LMHeadModel, BertForMaskedLM and Llama-family causal LMs (Llama, Mistral, Qwen2, Qwen3: q/k/v/o "
        f"and gate/up/down projections), not for {type(inner).__name__}, which has no plan; use parallel.tp=1 "
        f"(data parallel works with any model) or a model with a plan"
    )


def check_tp(model: nn.Module, tp: int) -> None:
    """Raise ValueError unless the model has a plan and its heads, MLP width and vocabulary divide by tp."""
    inner, plan = plan_of(model)
    n_head, d_ff, vocab, kv = plan.sizes(inner)
    for what, n in (
        ("attention heads (n_head)", n_head),
        ("MLP width (d_ff)", d_ff),
        ("vocabulary (vocab_size)", vocab),
        *((("key/value heads (num_key_value_heads)", kv),) if kv else ()),
    ):
        if n % tp:
            fix = [d for d in range(tp, 0, -1) if n % d == 0][0]
            raise ValueError(
                f"parallel.tp={tp} must divide the model's {what} = {n}: use parallel.tp={fix}"
                + (" or pad the vocabulary (model.vocab_size) to a multiple of tp" if "vocab" in what else "")
            )


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Shard `model` in place over the 1-D `tp_mesh`; returns it. Weights must already be identical on all tp ranks.

    `model` is one with a plan (see the module docstring): a graphtrain GPT-2 / BERT, a pipeline stage of a
    graphtrain GPT-2 (`pipeline.GPT2Stage`), or a Hugging Face model with a plan, alone or in model.hf's wrapper."""
    tp = tp_mesh.size()
    if tp == 1:
        return model
    check_tp(model, tp)
    inner, plan = plan_of(model)
    plan.apply(inner, tp_mesh)
    if inner is not model:  # the model.hf wrapper: its fused-parameter maps name the wrapper's parameters
        for attr in (FUSED_ATTR, FUSED_DIM_ATTR):
            if hasattr(inner, attr):
                setattr(model, attr, {f"hf.{k}": v for k, v in getattr(inner, attr).items()})
    return model
