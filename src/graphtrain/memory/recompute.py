"""Activation recompute under a memory budget, as an AOTAutograd partition function.

Modes (``EngineConfig.recompute``), all built on PyTorch's min-cut partitioner and its checkpoint
policies (``node.meta["recompute"]``: ``MUST_SAVE`` / ``PREFER_RECOMPUTE``, as torch.utils.checkpoint
regions are compiled):

- ``none``: AOTAutograd's ``default_partition``: save every forward value the backward reads.
- ``selective``: Megatron-style selective activation recompute. The attention core (the score matmul
  q @ k^T and what follows it up to the matmul with v: scale, mask, softmax, dropout) is recomputed,
  which removes the seq x seq x heads tensors that dominate activation memory at long sequences for
  one extra batched matmul per layer; beyond that the min-cut may recompute cheap ops (pointwise,
  views, layer norm, graphtrain's fused ops whose descriptor says ``recompute="cheap"``). Other
  matmuls, reductions, embeddings and random draws are saved.
- ``full``: whole-layer checkpointing. Each repeated layer (a child of an ``nn.ModuleList``, found from
  the nodes' ``nn_module_stack`` or the layer annotation ``pipeline/functional.py`` adds) is a checkpoint region:
  its inputs from earlier layers are saved (``MUST_SAVE``), everything inside is recomputed in the
  backward (``PREFER_RECOMPUTE``), matmuls included. The last layer is not checkpointed: its
  backward runs first, right after its forward, so recomputing it would save nothing. A graph
  without repeated layers falls back to the min-cut saving the smallest set without recomputing
  matmuls.
- ``auto``: tries none, selective, full, then full with PyTorch's activation-memory-budget solver at
  falling budgets (stopping once two in a row give the same partition), and keeps the first whose
  predicted step peak fits ``memory_budget``: least added compute first. When ``full`` is the first to
  fit, it then bisects for the fewest layers to checkpoint (the earliest ones: ``layers=k``) that still
  fit, since each costs a re-run of its forward.

What graphtrain's own ops allow comes from their descriptors (kernels/registry.py): ``random``, and
``recompute`` (cheap / reduction / compute-bound / never); a custom op without a descriptor is always
saved. Random ops are never recomputed. ATen dropout (``memory/rewrites.py``): the joint graph is
rewritten so dropout's output is ``x * mask * scale`` from the saved bool mask (bitwise what ATen's CPU
``native_dropout`` computes, checked in tests), so the 1-byte mask is saved and the 4-byte output can be
recomputed.
graphtrain's fused dropout (``graphtrain::bias_dropout_add``, hash RNG) is split into its seed draw
and a deterministic op (``memory/seeded.py``), so only 8 bytes of seed are saved per dropout.

Every partition records a ``RecomputeChoice`` (saved bytes, bytes saved vs none, FLOPs added,
recomputed ops, checkpointed layers) in a ``RecomputeRecord`` that the report prints.
"""

from __future__ import annotations

import collections
import contextlib
import operator
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._functorch import config as fconfig
from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition
from torch.utils.checkpoint import CheckpointPolicy

from graphtrain.kernels.registry import CHEAP, COMPUTE_BOUND, NEVER, op_descriptor
from graphtrain.memory.budget import budget_bytes
from graphtrain.memory.predict import MiB, hint_int, predict_peak, saved_activation_bytes
from graphtrain.memory.rewrites import drop_dead_random_ops, rewrite_dropout_for_recompute, shrink_attention_masks
from graphtrain.memory.seeded import split_fused_dropout
from graphtrain.passes.graph_utils import copy_graph, is_random

aten = torch.ops.aten
graphtrain_ops = torch.ops.graphtrain
# ATen ops never recomputed by selective (outside the attention core): their outputs are what a checkpoint
# keeps. graphtrain's own: descriptor recompute="compute-bound".
COMPUTE_INTENSIVE = {
    aten.mm,
    aten.bmm,
    aten.addmm,
    aten.baddbmm,
    aten.convolution,
    aten._convolution,
    aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_flash_attention,
    aten.linear,
    aten.matmul,
}
# Not pointwise, yet cheap: selective may recompute them. graphtrain's own: descriptor recompute="cheap".
SELECTIVE_EXTRA = {aten.native_layer_norm, aten.clone, aten._to_copy, aten.expand, aten.slice, aten.select}
# The attention core: what may follow the score matmul before the matmul with v.
SOFTMAX = {aten._softmax, aten._safe_softmax, aten.softmax}
AUTO_BUDGETS = (0.8, 0.6, 0.4, 0.25, 0.1, 0.02)  # activation_memory_budget fractions auto tries


def _packet(n: fx.Node) -> Any:
    return getattr(n.target, "overloadpacket", None)


def _recompute_class(n: fx.Node) -> str | None:
    """A graphtrain op's descriptor's `recompute` (cheap | reduction | compute-bound | never), else None."""
    d = op_descriptor(n.target)
    return None if d is None else d.recompute


def _is_compute_intensive(n: fx.Node) -> bool:
    return _packet(n) in COMPUTE_INTENSIVE or _recompute_class(n) == COMPUTE_BOUND


def _never_recomputed(n: fx.Node) -> bool:
    """A custom (non-ATen) op that is always saved: its descriptor says so, or it has none (its schema cannot
    tell us it is not random)."""
    t = n.target
    return (
        isinstance(t, torch._ops.OpOverload)
        and t.namespace not in ("aten", "prims")
        and _recompute_class(n) in (None, NEVER)
    )


def is_cheap(n: fx.Node) -> bool:
    """Selective mode may recompute this: pointwise, views, getitem, layer norm, cheap fused ops."""
    if n.op != "call_function" or is_random(n):
        return False
    if n.target is operator.getitem:
        return True
    t = n.target
    if isinstance(t, torch._ops.OpOverload):
        return (
            torch.Tag.pointwise in t.tags
            or t.is_view
            or t.overloadpacket in SELECTIVE_EXTRA
            or _recompute_class(n) == CHEAP
        )
    return False


def backward_region(joint: fx.GraphModule) -> set[fx.Node]:
    """Nodes that depend on a tangent (the backward); the rest is the forward."""
    bw: set[fx.Node] = set()
    for n in joint.graph.nodes:
        if (n.op == "placeholder" and "tangents" in n.name) or any(a in bw for a in n.all_input_nodes):
            if n.op != "output":
                bw.add(n)
    return bw


def _numel(n: Any) -> int:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return hint_int(v.numel()) if isinstance(v, torch.Tensor) else 0


def attention_cores(joint: fx.GraphModule, bw: set[fx.Node] | None = None) -> list[list[fx.Node]]:
    """The attention cores of the forward: a batched matmul whose output is at least as large as its inputs
    together (q @ k^T: seq x seq per head from two seq x head_dim operands), with the views, pointwise
    ops, softmax and (seeded or mask-rewritten) dropout that follow it, up to the next matmul (@ v).
    Megatron's selective recompute region: its tensors are the s*s*heads term of activation memory."""
    bw = backward_region(joint) if bw is None else bw
    cores = []
    for n in joint.graph.nodes:
        if n.op != "call_function" or n in bw or _packet(n) not in (aten.bmm, aten.matmul):
            continue
        ins = [a for a in n.args if isinstance(a, fx.Node)]
        if _numel(n) < sum(_numel(a) for a in ins):
            continue
        core, todo = [n], list(n.users)
        seen = {n}
        while todo:
            u = todo.pop()
            if u in seen or u in bw or u.op != "call_function":
                continue
            seen.add(u)
            pk = _packet(u)
            ok = (
                u.target is operator.getitem
                or pk in SOFTMAX
                or pk is graphtrain_ops.bias_dropout_add_seeded
                or (
                    isinstance(u.target, torch._ops.OpOverload)
                    and not is_random(u)
                    and (torch.Tag.pointwise in u.target.tags or u.target.is_view or pk in (aten.clone, aten.expand))
                )
            )
            if ok:
                core.append(u)
                todo.extend(u.users)
        cores.append(core)
    return cores


_LAYER = re.compile(r"^(.*)\.(\d+)$")
_GETATTR = re.compile(r"getattr\(([^()]*), '(\w+)'\)")


def _module_path(path: str) -> str:
    """A Dynamo module path in dotted form. Dynamo writes a child it reached through ``getattr`` (a model called
    through ``torch.func.functional_call`` inside a compiled function: ``getattr(G['m'].blocks, '0')``) where a
    model compiled as itself gives ``L['self'].blocks.0``."""
    while (m := _GETATTR.search(path)) is not None:
        path = f"{path[: m.start()]}{m.group(1)}.{m.group(2)}{path[m.end() :]}"
    return path


def _layer_key(n: fx.Node) -> tuple[bool, str | None]:
    """(annotated?, layer path): graphtrain's capture annotation, else the outermost ``<list>.<index>`` entry
    of the node's nn_module_stack. (False, None) when the node carries no module information."""
    custom = n.meta.get("custom") or {}
    if "graphtrain_layer" in custom:
        return True, custom["graphtrain_layer"]
    stack = n.meta.get("nn_module_stack")
    if not stack:
        return False, None
    for path, _ in stack.values():
        if _LAYER.match(dotted := _module_path(str(path))):
            return True, dotted
    return True, None


def layer_regions(joint: fx.GraphModule, bw: set[fx.Node] | None = None) -> dict[fx.Node, int]:
    """Forward node -> index of the repeated layer it belongs to (in forward order).

    From the module information the tracer recorded; nodes without it (made by fusion passes or by
    the rewrites above) take the layer all their forward users agree on (a fused layer norm feeding a
    layer's first matmul belongs to that layer), else the latest layer among their inputs (a fused
    residual add belongs to the layer whose output it adds)."""
    bw = backward_region(joint) if bw is None else bw
    fw = [n for n in joint.graph.nodes if n.op == "call_function" and n not in bw]
    fw_set = set(fw)
    order: dict[str, int] = {}
    region: dict[fx.Node, int | None] = {}
    unknown = []
    for n in fw:
        annotated, key = _layer_key(n)
        if annotated:
            region[n] = None if key is None else order.setdefault(key, len(order))
        else:
            unknown.append(n)
    if len(order) < 2:
        return {}

    def users(n: fx.Node) -> list[fx.Node]:  # through getitems: a multi-output op goes where its results go
        out = []
        for u in n.users:
            if u not in fw_set:
                continue
            out.extend(users(u) if u.target is operator.getitem else [u])
        return out

    for n in reversed(unknown):
        if n.target is operator.getitem:
            continue
        us = users(n)
        rs = {region.get(u, -1) for u in us}
        if us and len(rs) == 1 and None not in rs and -1 not in rs:
            region[n] = rs.pop()
    for n in fw:
        if n.target is operator.getitem and isinstance(n.args[0], fx.Node) and n.args[0] in region:
            region[n] = region[n.args[0]]  # a getitem is where its op is
        elif n not in region:
            known = [r for a in n.all_input_nodes if (r := region.get(a)) is not None]
            region[n] = max(known) if known else None
    return {n: r for n, r in region.items() if r is not None}


def _node_flops(n: fx.Node) -> int:
    """FLOPs of one node: the flop counter's formula for matmul-like ops, else 1 per output element."""
    from torch.utils.flop_counter import flop_registry

    val = n.meta.get("val")
    pk = _packet(n)
    if pk in flop_registry:

        def shape(a: Any) -> Any:
            return tuple(hint_int(d) for d in a.meta["val"].shape) if isinstance(a, fx.Node) else a

        args = torch.utils._pytree.tree_map(shape, n.args)
        try:
            return hint_int(
                flop_registry[pk](
                    *args, out_shape=tuple(hint_int(d) for d in val.shape) if isinstance(val, torch.Tensor) else None
                )
            )
        except Exception:
            pass
    return hint_int(val.numel()) if isinstance(val, torch.Tensor) else 0


@dataclass
class RecomputeChoice:
    name: str
    saved_bytes: int
    bytes_saved: int  # against mode none
    flops_added: int
    recomputed_ops: dict[str, int]
    predicted_peak: int | None = None
    fits: bool | None = None
    what: str = ""  # the regions this mode recomputes, e.g. "4 attention cores" or "11 of 12 layers"

    def __str__(self) -> str:
        ops = ", ".join(f"{k} x{v}" for k, v in sorted(self.recomputed_ops.items(), key=lambda kv: -kv[1])[:6])
        peak = (
            ""
            if self.predicted_peak is None
            else f", peak {self.predicted_peak / MiB:,.0f} MiB"
            + ("" if self.fits is None else (" fits" if self.fits else " over budget"))
        )
        return (
            f"{self.name:<12} saved {self.saved_bytes / MiB:9,.1f} MiB (-{self.bytes_saved / MiB:,.1f}), "
            f"+{self.flops_added / 1e9:.3f} GFLOP recomputed{peak}"
            + (f" ({self.what})" if self.what else "")
            + (f" [{ops}]" if ops else "")
        )


@dataclass
class RecomputeRecord:
    """Decisions of one partition call: every candidate tried and which one was kept."""

    mode: str
    budget: float | None = None
    choices: list[RecomputeChoice] = field(default_factory=list)
    chosen: str | None = None
    dropout_rewrites: int = 0  # aten dropouts rewritten to x * saved mask * scale
    seeded_dropouts: int = 0  # graphtrain fused dropouts split into seed draw + deterministic op (seeded.py)
    masks_shrunk: int = 0  # full-size additive attention masks rebuilt at their broadcast size
    dead_random_dropped: int = 0  # unused random ops removed from the backward (see drop_dead_random_ops)

    def __str__(self) -> str:
        head = f"recompute={self.mode}" + (f" budget {self.budget / MiB:,.0f} MiB" if self.budget else "")
        return "\n".join(
            [head + f", chose {self.chosen}"]
            + [("* " if c.name == self.chosen else "  ") + str(c) for c in self.choices]
        )


def _save(n: fx.Node) -> None:
    """Mark `n` saved for the backward. A multi-output op (a tuple: fused norm, attention, the fused linear
    cross-entropy, ...) is marked MUST_SAVE on itself and on its getitems. On itself, because that is what bans
    recomputing it: torch 2.13's min-cut ignores a getitem's tag, and with only its getitems marked it recomputed
    BERT's whole fused MLM head and loss in the backward (selective; its inputs were smaller than its gradients).
    On its getitems, because AOTAutograd cannot save a tuple: they are what gets saved (_no_tuples_saved turns a
    chosen tuple into them). An output of such an op (a getitem) is saved through its op, for the first reason:
    a post-norm layer's output is a getitem of a fused layer norm, and with only it marked each checkpointed
    layer's recompute started from the previous layer's (BERT-Large: the whole encoder re-ran at the start of the
    backward, 166 MiB more peak per sample)."""
    parent = n.args[0] if n.target is operator.getitem else None
    if isinstance(parent, fx.Node) and isinstance(parent.meta.get("val"), (tuple, list)):
        n = parent
    if isinstance(n.meta.get("val"), (tuple, list)):
        for user in n.users:
            if user.target is operator.getitem:
                user.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    n.meta["recompute"] = CheckpointPolicy.MUST_SAVE


def tag_for_recompute(joint: fx.GraphModule, how: str, layers: int | None = None) -> dict[str, Any]:
    """Set checkpoint policies on the forward nodes of `joint` for mode `how` (selective|full). `full` checkpoints
    every layer but the last, or only the first `layers` of them.

    Returns what was found: attention cores recomputed, layers checkpointed (and which one was left)."""
    bw = backward_region(joint)
    fw = [n for n in joint.graph.nodes if n.op == "call_function" and n not in bw]
    info: dict[str, Any] = {
        "attention_cores": 0,
        "layers": 0,
        "fused_attention": sum(_packet(n) is graphtrain_ops.attention for n in fw),
    }
    never = {n for n in fw if is_random(n) or _never_recomputed(n)}
    never |= {n for n in fw if n.target is operator.getitem and n.args[0] in never}  # a mask, a seed
    for n in never:
        _save(n)
    if how == "selective":
        core = set()
        for c in attention_cores(joint, bw):
            core.update(c)
            info["attention_cores"] += 1
        for n in fw:
            if n in never:
                continue
            if n in core:
                n.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
            elif not is_cheap(n) or _is_compute_intensive(n):
                _save(n)
        return info
    regions = layer_regions(joint, bw)
    last = max(regions.values(), default=-1)
    chosen = sorted(set(regions.values()) - {last})[:layers]  # the earliest layers (all of them: layers=None)
    checkpointed = {n: r for n, r in regions.items() if r in chosen and n not in never}
    for n in fw:
        if n in never:
            continue
        r = checkpointed.get(n)
        if r is None:
            if _is_compute_intensive(n):
                _save(n)
            continue
        n.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
        n.meta["ac_graph_id"] = r + 1
    for n, r in checkpointed.items():  # the layer's outputs read by later code: the checkpoint boundary
        if isinstance(n.meta.get("val"), torch.Tensor) and any(
            u.op == "call_function" and u not in bw and regions.get(u) != r for u in n.users
        ):
            _save(n)
    info["layers"] = len(set(checkpointed.values()))
    info["layers_total"] = last + 1
    info["layers_possible"] = len(set(regions.values()) - {last})
    return info


def _partition(
    joint: fx.GraphModule,
    joint_inputs: Any,
    num_fwd_outputs: int,
    how: str,
    budget_fraction: float = 1.0,
    info: dict | None = None,
    layers: int | None = None,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    if how == "none":
        return default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs)
    found = tag_for_recompute(joint, how, layers)
    if info is not None:
        info.update(found)
    with (
        fconfig.patch(
            aggressive_recomputation=True, ban_recompute_reductions=False, activation_memory_budget=budget_fraction
        ),
        _no_tuples_saved(),
    ):
        return min_cut_rematerialization_partition(
            joint, joint_inputs, compiler="graphtrain", num_fwd_outputs=num_fwd_outputs
        )


@contextlib.contextmanager
def _no_tuples_saved() -> Iterator[None]:
    """Work around torch 2.13's partitioner: when every banned node of the budget search is MUST_SAVE, it returns
    them as the saved values as they are, and a random multi-output fused op (MUST_SAVE so that nothing
    recomputes it: it draws its seed inside) is a tuple AOTAutograd cannot save ("expected all
    tensors_saved_with_vc_check to be Tensors"). Each such node in the chosen set becomes its getitems (the same
    tensors, saved one by one). Written by hand because the choice happens inside torch's partitioner; the
    patch lives only for one partition call."""
    import torch._functorch.partitioners as partitioners

    original = partitioners.choose_saved_values_set

    def choose(*args: Any, **kwargs: Any) -> list[fx.Node]:
        out: list[fx.Node] = []
        for n in original(*args, **kwargs):
            parts = (
                [u for u in n.users if u.target is operator.getitem]
                if isinstance(n.meta.get("val"), (tuple, list))
                else [n]
            )
            out.extend(p for p in parts if p not in out)
        return out

    partitioners.choose_saved_values_set = choose
    try:
        yield
    finally:
        partitioners.choose_saved_values_set = original


def describe(
    name: str, fw_gm: fx.GraphModule, bw_gm: fx.GraphModule, num_fwd_outputs: int, none_saved: int | None
) -> RecomputeChoice:
    saved = saved_activation_bytes(fw_gm, num_fwd_outputs)
    ops: collections.Counter = collections.Counter()
    flops = 0
    for n in bw_gm.graph.nodes:
        if (
            n.op == "call_function"
            and n.meta.get("graphtrain_forward_op")
            and n.target is not operator.getitem
            and not getattr(n.target, "is_view", False)
        ):
            ops[str(_packet(n) or n.target).replace("aten.", "")] += 1
            flops += _node_flops(n)
    return RecomputeChoice(name, saved, (none_saved - saved) if none_saved is not None else 0, flops, dict(ops))


def _what(how: str, info: dict[str, Any]) -> str:
    if how == "selective":
        what = f"{info.get('attention_cores', 0)} attention cores recomputed"
        if info.get("fused_attention"):  # graphtrain::attention rebuilds its probabilities in its own backward
            what += f", {info['fused_attention']} fused attention ops (nothing seq x seq saved)"
        return what
    if how == "full":
        if not info.get("layers"):
            return "no repeated layers found: min-cut without matmul recompute"
        if info["layers"] < info.get("layers_possible", info["layers"]):
            return f"{info['layers']} of {info['layers_total']} layers checkpointed (the first {info['layers']})"
        return f"{info['layers']} of {info['layers_total']} layers checkpointed (the last is not)"
    return ""


def make_partition_fn(
    engine_cfg: Any,
    *,
    n_params_bytes: int = 0,
    n_param_inputs: int | None = None,
    optimizer: str = "adamw",
    device_memory: int | None = None,
    records: list[RecomputeRecord] | None = None,
    **predict_kw: Any,
) -> Callable[..., Any]:
    """A partition_fn for ``aot_function``/``aot_module_simplified`` implementing engine_cfg.recompute.

    n_params_bytes / n_param_inputs / optimizer feed the peak prediction `auto` compares with
    engine_cfg.memory_budget (bytes, or a fraction of `device_memory`, by default of the memory of the device the
    joint graph's inputs are on: graphtrain.memory.budget). Each call appends a RecomputeRecord to `records` (if
    given)."""
    mode = getattr(engine_cfg, "recompute", "none")
    given = getattr(engine_cfg, "memory_budget", None)
    if mode == "auto" and given is None:
        raise ValueError("engine.recompute=auto needs engine.memory_budget (bytes, or a fraction of device memory)")

    def partition_fn(joint: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, **kw: Any):
        budget = None
        if given is not None:
            budget = (
                given * device_memory if device_memory and given <= 1 else budget_bytes(given, _device_of(joint_inputs))
            )
        rec = RecomputeRecord(mode, budget)
        rec.masks_shrunk = shrink_attention_masks(joint)
        none_saved = None
        if mode != "none":  # the reference: what mode none would save
            ref_fw, _ = _partition(copy_graph(joint), joint_inputs, num_fwd_outputs, "none")
            none_saved = saved_activation_bytes(ref_fw, num_fwd_outputs)
            rec.dropout_rewrites = rewrite_dropout_for_recompute(joint)
            rec.seeded_dropouts = split_fused_dropout(joint)
        bw_nodes = backward_region(joint)
        for n in joint.graph.nodes:  # copied nodes keep their meta: marks recomputed ones in the backward
            if n.op == "call_function" and n not in bw_nodes:
                n.meta["graphtrain_forward_op"] = True
        ladder = {
            "none": [("none", 1.0)],
            "selective": [("selective", 1.0)],
            "full": [("full", 1.0)],
            "auto": [("none", 1.0), ("selective", 1.0), ("full", 1.0)] + [(f"budget={b}", b) for b in AUTO_BUDGETS],
        }[mode]

        def attempt(name: str, how: str, frac: float = 1.0, layers: int | None = None) -> tuple[Any, dict]:
            info: dict[str, Any] = {}
            fw, bw = _partition(copy_graph(joint), joint_inputs, num_fwd_outputs, how, frac, info, layers)
            rec.dead_random_dropped = drop_dead_random_ops(bw)
            choice = describe(name, fw, bw, num_fwd_outputs, none_saved)
            choice.what = _what(how, info)
            if budget is not None:
                est = predict_peak(
                    fw,
                    bw,
                    n_params_bytes,
                    optimizer=optimizer,
                    num_user_outputs=num_fwd_outputs,
                    n_param_inputs=n_param_inputs,
                    **predict_kw,
                )
                choice.predicted_peak, choice.fits = est.peak, est.peak <= budget
            rec.choices.append(choice)
            return (choice, fw, bw), info

        best, last_budget = None, None
        for name, frac in ladder:
            tried, info = attempt(name, "full" if name.startswith("budget") else name, frac)
            if name == "none":
                none_saved = tried[0].saved_bytes
            if best is None or (tried[0].predicted_peak or 0) < (best[0].predicted_peak or 0):
                best = tried
            if mode != "auto" or tried[0].fits:
                best = tried
                if mode == "auto" and name == "full":
                    # checkpoint only as many layers as the budget needs (each costs a re-run of its forward).
                    # The predicted peak falls as layers are added, though not strictly (a recomputed layer's
                    # working set sits on top): bisection finds few layers that fit, not always the fewest.
                    lo, hi = 1, info.get("layers", 0)
                    while lo < hi:
                        mid = (lo + hi) // 2
                        fewer, _ = attempt(f"layers={mid}", "full", layers=mid)
                        if fewer[0].fits:
                            hi, best = mid, fewer
                        else:
                            lo = mid + 1
                break
            if name.startswith("budget"):
                # two budgets in a row gave the same partition: the solver has nothing left to recompute (seen
                # with every layer checkpointed), so the lower ones would only repeat it
                outcome = (tried[0].saved_bytes, tried[0].predicted_peak)
                if outcome == last_budget:
                    break
                last_budget = outcome
        assert best is not None
        rec.chosen = best[0].name
        if records is not None:
            records.append(rec)
        return best[1], best[2]

    partition_fn.records = records  # type: ignore[attr-defined]
    return partition_fn


def _device_of(joint_inputs: Any) -> torch.device:
    """The device of the first tensor among a joint graph's inputs (CPU when there is none)."""
    for x in torch.utils._pytree.tree_leaves(joint_inputs):
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")
