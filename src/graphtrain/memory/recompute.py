"""Activation recompute under a memory budget, as an AOTAutograd partition function.

Modes (``EngineConfig.recompute``):

- ``none``: AOTAutograd's ``default_partition``: save every forward value the backward reads.
- ``selective``: PyTorch's min-cut partitioner, allowed to recompute only cheap ops: pointwise
  ops, views and layer norm. Matmuls, softmax, reductions, embeddings and random ops are saved.
- ``full``: the min-cut partitioner allowed to recompute everything except compute-intensive ops
  (matmul/conv/attention outputs) and random ops; it saves the smallest set it can.
- ``auto``: tries none, selective, full, then full with PyTorch's activation-memory-budget solver
  (which may also recompute matmuls) at falling budgets, and keeps the first whose predicted step
  peak fits ``memory_budget``: cheap recompute first, larger regions only when needed.

Dropout: random ops are never recomputed (a recomputed mask would differ). Instead the joint
graph is rewritten so dropout's output is ``x * mask * scale`` from the saved bool mask, which is
bitwise what ATen's CPU ``native_dropout`` computes (checked in tests), so the partitioner can
save the 1-byte mask and recompute the 4-byte output.

Every partition records a ``RecomputeChoice`` (saved bytes, bytes saved vs none, FLOPs added,
recomputed ops) in a ``RecomputeRecord`` that the report prints.
"""
from __future__ import annotations

import collections
import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
from torch._functorch import config as fconfig
from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition
from torch._guards import detect_fake_mode
from torch.utils.checkpoint import CheckpointPolicy

from graphtrain.memory.predict import MiB, hint_int, predict_peak, saved_activation_bytes

aten = torch.ops.aten
# Never recomputed by selective/full: their outputs are what a checkpoint boundary keeps.
COMPUTE_INTENSIVE = {aten.mm, aten.bmm, aten.addmm, aten.baddbmm, aten.convolution, aten._convolution,
                     aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_efficient_attention,
                     aten._scaled_dot_product_flash_attention, aten.linear, aten.matmul}
SELECTIVE_EXTRA = {aten.native_layer_norm, aten.clone, aten._to_copy, aten.expand, aten.slice, aten.select}
AUTO_BUDGETS = (0.8, 0.6, 0.4, 0.25, 0.1, 0.02)  # activation_memory_budget fractions auto tries


def _packet(n: fx.Node) -> Any:
    return getattr(n.target, "overloadpacket", None)


def is_random(n: fx.Node) -> bool:
    return n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and \
        torch.Tag.nondeterministic_seeded in n.target.tags


def is_cheap(n: fx.Node) -> bool:
    """Selective mode may recompute this: pointwise, views, getitem, layer norm."""
    if n.op != "call_function" or is_random(n):
        return False
    if n.target is operator.getitem:
        return True
    t = n.target
    if isinstance(t, torch._ops.OpOverload):
        return torch.Tag.pointwise in t.tags or t.is_view or t.overloadpacket in SELECTIVE_EXTRA
    return False


def backward_region(joint: fx.GraphModule) -> set[fx.Node]:
    """Nodes that depend on a tangent (the backward); the rest is the forward."""
    bw: set[fx.Node] = set()
    for n in joint.graph.nodes:
        if (n.op == "placeholder" and "tangents" in n.name) or any(a in bw for a in n.all_input_nodes):
            if n.op != "output":
                bw.add(n)
    return bw


def rewrite_dropout_for_recompute(joint: fx.GraphModule) -> int:
    """Make dropout outputs recomputable: uses of native_dropout(x)[0] read x * mask * scale."""
    count = 0
    for n in list(joint.graph.nodes):
        if n.op != "call_function" or n.target is not aten.native_dropout.default:
            continue
        x, p = n.args[0], n.args[1]
        outs = [u for u in n.users if u.target is operator.getitem and u.args[1] == 0 and u.users]
        masks = [u for u in n.users if u.target is operator.getitem and u.args[1] == 1]
        if not outs or not masks or p >= 1.0:
            continue
        scale = 1.0 / (1.0 - p)
        mask = masks[0]
        fake = detect_fake_mode([x.meta["val"]])
        with joint.graph.inserting_after(mask):
            m1 = joint.graph.call_function(aten.mul.Tensor, (x, mask))
        with joint.graph.inserting_after(m1):
            m2 = joint.graph.call_function(aten.mul.Tensor, (m1, scale))
        with fake:
            m1.meta["val"] = aten.mul.Tensor(x.meta["val"], mask.meta["val"])
            m2.meta["val"] = aten.mul.Tensor(m1.meta["val"], scale)
        for key in ("stack_trace", "nn_module_stack", "seq_nr", "partitioner_tag"):
            if key in n.meta:
                m1.meta[key] = m2.meta[key] = n.meta[key]
        for o in outs:
            o.replace_all_uses_with(m2)
        count += 1
    joint.graph.eliminate_dead_code()
    joint.recompile()
    return count


def drop_dead_random_ops(gm: fx.GraphModule) -> int:
    """Erase random ops whose results nobody reads, then dead code.

    AOTAutograd's partitioners copy into the backward every forward node computable from the saved
    values; DCE then keeps random ops (impure). Measured on gpt2-tiny with default_partition: the
    backward re-ran bmm, scale, mask, softmax and native_dropout of each attention layer and threw
    the result away, costing compute and advancing the RNG (so the next step's dropout differs
    from eager's)."""
    count = 0
    for n in reversed(list(gm.graph.nodes)):
        if is_random(n) and all(u.target is operator.getitem and not u.users for u in n.users):
            for u in list(n.users):
                gm.graph.erase_node(u)
            gm.graph.erase_node(n)
            count += 1
    if count:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return count


def _copy(joint: fx.GraphModule) -> fx.GraphModule:
    g = fx.Graph()
    out = g.graph_copy(joint.graph, {})
    g.output(out)
    return fx.GraphModule(joint, g)


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
            return hint_int(flop_registry[pk](*args, out_shape=tuple(hint_int(d) for d in val.shape)
                                              if isinstance(val, torch.Tensor) else None))
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

    def __str__(self) -> str:
        ops = ", ".join(f"{k} x{v}" for k, v in sorted(self.recomputed_ops.items(), key=lambda kv: -kv[1])[:6])
        peak = "" if self.predicted_peak is None else f", peak {self.predicted_peak / MiB:,.0f} MiB" + \
            ("" if self.fits is None else (" fits" if self.fits else " over budget"))
        return (f"{self.name:<12} saved {self.saved_bytes / MiB:9,.1f} MiB (-{self.bytes_saved / MiB:,.1f}), "
                f"+{self.flops_added / 1e9:.3f} GFLOP recomputed{peak}" + (f" [{ops}]" if ops else ""))


@dataclass
class RecomputeRecord:
    """Decisions of one partition call: every candidate tried and which one was kept."""

    mode: str
    budget: float | None = None
    choices: list[RecomputeChoice] = field(default_factory=list)
    chosen: str | None = None
    dropout_rewrites: int = 0
    dead_random_dropped: int = 0  # unused random ops removed from the backward (see drop_dead_random_ops)

    def __str__(self) -> str:
        head = f"recompute={self.mode}" + (f" budget {self.budget / MiB:,.0f} MiB" if self.budget else "")
        return "\n".join([head + f", chose {self.chosen}"] + [("* " if c.name == self.chosen else "  ") + str(c)
                                                               for c in self.choices])


def _partition(joint: fx.GraphModule, joint_inputs: Any, num_fwd_outputs: int, how: str,
               budget_fraction: float = 1.0) -> tuple[fx.GraphModule, fx.GraphModule]:
    if how == "none":
        return default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs)
    bw = backward_region(joint)
    for n in joint.graph.nodes:
        if n.op != "call_function" or n in bw:
            continue
        if is_random(n) or _packet(n) in COMPUTE_INTENSIVE or (how == "selective" and not is_cheap(n)):
            n.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    with fconfig.patch(aggressive_recomputation=True, ban_recompute_reductions=False,
                       activation_memory_budget=budget_fraction):
        return min_cut_rematerialization_partition(joint, joint_inputs, compiler="graphtrain",
                                                   num_fwd_outputs=num_fwd_outputs)


def describe(name: str, fw_gm: fx.GraphModule, bw_gm: fx.GraphModule,
             num_fwd_outputs: int, none_saved: int | None) -> RecomputeChoice:
    saved = saved_activation_bytes(fw_gm, num_fwd_outputs)
    ops: collections.Counter = collections.Counter()
    flops = 0
    for n in bw_gm.graph.nodes:
        if n.op == "call_function" and n.meta.get("graphtrain_forward_op") and n.target is not operator.getitem \
                and not getattr(n.target, "is_view", False):
            ops[str(_packet(n) or n.target).replace("aten.", "")] += 1
            flops += _node_flops(n)
    return RecomputeChoice(name, saved, (none_saved - saved) if none_saved is not None else 0, flops, dict(ops))


def make_partition_fn(engine_cfg: Any, *, n_params_bytes: int = 0, n_param_inputs: int | None = None,
                      optimizer: str = "adamw", device_memory: int | None = None,
                      records: list[RecomputeRecord] | None = None, **predict_kw: Any) -> Callable[..., Any]:
    """A partition_fn for ``aot_function``/``aot_module_simplified`` implementing engine_cfg.recompute.

    n_params_bytes / n_param_inputs / optimizer feed the peak prediction `auto` compares with
    engine_cfg.memory_budget (bytes, or a fraction of `device_memory`, default total RAM).
    Each call appends a RecomputeRecord to `records` (if given)."""
    mode = getattr(engine_cfg, "recompute", "none")
    budget = getattr(engine_cfg, "memory_budget", None)
    if budget is not None and budget <= 1:
        budget = budget * (device_memory or total_device_memory())
    if mode == "auto" and budget is None:
        raise ValueError("engine.recompute=auto needs engine.memory_budget (bytes, or a fraction of device memory)")

    def partition_fn(joint: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, **kw: Any):
        rec = RecomputeRecord(mode, budget)
        none_saved = None
        if mode != "none":  # the reference: what mode none would save
            ref_fw, _ = _partition(_copy(joint), joint_inputs, num_fwd_outputs, "none")
            none_saved = saved_activation_bytes(ref_fw, num_fwd_outputs)
            rec.dropout_rewrites = rewrite_dropout_for_recompute(joint)
        bw_nodes = backward_region(joint)
        for n in joint.graph.nodes:  # copied nodes keep their meta: marks recomputed ones in the backward
            if n.op == "call_function" and n not in bw_nodes:
                n.meta["graphtrain_forward_op"] = True
        ladder = {"none": [("none", 1.0)], "selective": [("selective", 1.0)], "full": [("full", 1.0)],
                  "auto": [("none", 1.0), ("selective", 1.0), ("full", 1.0)] +
                          [(f"budget={b}", b) for b in AUTO_BUDGETS]}[mode]
        best = None
        for name, frac in ladder:
            how = "full" if name.startswith("budget") else name
            fw, bw = _partition(_copy(joint), joint_inputs, num_fwd_outputs, how, frac)
            rec.dead_random_dropped = drop_dead_random_ops(bw)
            choice = describe(name, fw, bw, num_fwd_outputs, none_saved)
            if name == "none":
                none_saved = choice.saved_bytes
            if budget is not None:
                est = predict_peak(fw, bw, n_params_bytes, optimizer=optimizer, num_user_outputs=num_fwd_outputs,
                                   n_param_inputs=n_param_inputs, **predict_kw)
                choice.predicted_peak, choice.fits = est.peak, est.peak <= budget
            rec.choices.append(choice)
            if best is None or (choice.predicted_peak or 0) < (best[0].predicted_peak or 0):
                best = (choice, fw, bw)
            if mode != "auto" or choice.fits:
                best = (choice, fw, bw)
                break
        assert best is not None
        rec.chosen = best[0].name
        if records is not None:
            records.append(rec)
        return best[1], best[2]

    partition_fn.records = records  # type: ignore[attr-defined]
    return partition_fn


def total_device_memory() -> int:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read total memory from /proc/meminfo")
