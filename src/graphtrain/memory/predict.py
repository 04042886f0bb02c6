"""Peak-memory prediction from the partitioned forward/backward graphs, before anything runs.

A training step holds, at its peak, the persistent state (parameters, gradients, optimizer state)
plus what the graphs hold at that moment: the saved activations (forward outputs the backward
reads) and the transient buffers of the op being run. We get the graph part by a liveness walk
over each graph in execution order (``graph_liveness``): a buffer is one storage (views and
in-place results alias their base: we key buffers by the fake tensor's storage), it lives from
the node that first produces it to the last node that reads any alias of it, graph outputs live
past the end, and graph inputs are either external (parameters, the batch: counted elsewhere) or,
under AOTAutograd's boxed calling convention, freed at their last use (the saved activations in
the backward).

Step timeline modelled (per AOTAutograd's calling convention, ``zero_grad(set_to_none=True)``):

  forward:   params + opt state + batch + forward live set (saved activations accumulate in it)
  backward:  params + opt state + batch + backward live set (saved, freed at last use if boxed;
             gradients, produced and held to the end)
  optimizer: params + grads + opt state + the optimizer's temporaries

The peak is the largest of the three. Fused ops that allocate scratch memory inside themselves
(graphtrain::attention's CPU scores with dropout, linear_cross_entropy's logits chunks) add it at
their node (``op_workspace_bytes``, from each op's descriptor beside its kernel): the graph only shows
their outputs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

import graphtrain.kernels  # noqa: F401  (registers the fused ops' descriptors)
from graphtrain.kernels.registry import hint_int, op_descriptor

MiB = 1024 * 1024

# Optimizer state in units of parameter bytes (fp32 moments): AdamW and LAMB keep two moments.
OPTIMIZER_STATE_FACTOR = {"adamw": 2.0, "adam": 2.0, "lamb": 2.0, "sgd": 0.0, "none": 0.0}


def _tensors(val: Any) -> list[torch.Tensor]:
    return [v for v in pytree.tree_leaves(val) if isinstance(v, torch.Tensor)]


def storage_key(t: torch.Tensor) -> int:
    """An identity shared by a tensor and all its views (fake tensors track storage too)."""
    return t.untyped_storage()._cdata


def storage_bytes(t: torch.Tensor) -> int:
    try:
        return hint_int(t.untyped_storage().nbytes())
    except Exception:  # sparse / odd subclasses: fall back to the dense size
        return hint_int(t.numel()) * t.element_size()


def node_keys(n: fx.Node) -> list[tuple[int, int]]:
    """(storage key, bytes) of every tensor node `n` produces (from meta['val'])."""
    return [(storage_key(t), storage_bytes(t)) for t in _tensors(n.meta.get("val"))]


def op_workspace_bytes(n: fx.Node) -> int:
    """Bytes a fused op allocates and frees inside itself (its graph node shows only its outputs): its
    descriptor's ``workspace_bytes`` (kernels/<op>.py); 0 for other ops, or when the node lacks what it reads."""
    d = op_descriptor(n.target)
    if d is None:
        return 0
    try:
        return d.workspace_bytes(n)
    except (AttributeError, IndexError, KeyError, TypeError):
        return 0


@dataclass
class Liveness:
    """Result of walking one graph: its peak live bytes and what is live when it ends."""

    peak_bytes: int
    peak_node: str
    output_bytes: int  # storages the graph returns that are not external inputs
    input_bytes: int  # counted (non-external) input storages
    steps: int
    allocated_bytes: int = 0  # sum of every buffer the graph allocates (reuse lowers it)


def graph_liveness(gm: fx.GraphModule, external: set[int] | None = None, free_inputs: bool = True) -> Liveness:
    """Peak bytes live while `gm` runs, counting intermediates, outputs and non-external inputs.

    external: storage keys owned outside the graph (parameters, user batch): never counted.
    free_inputs: inputs are released at their last use (boxed calling convention, where the
    graph clears its argument list); otherwise they live until the graph returns."""
    external = set(external or ())
    nodes = list(gm.graph.nodes)
    size: dict[int, int] = {}
    last_use: dict[int, int] = {}
    produced_at: dict[int, int] = {}
    inputs: set[int] = set()
    outputs: set[int] = set()
    for i, n in enumerate(nodes):
        if n.op == "output":
            for a in pytree.tree_leaves(n.args[0]):
                if isinstance(a, fx.Node):
                    outputs.update(k for k, _ in node_keys(a))
            continue
        for k, b in node_keys(n):
            size[k] = max(size.get(k, 0), b)
            produced_at.setdefault(k, i)
            last_use[k] = max(last_use.get(k, i), i)
            if n.op == "placeholder":
                inputs.add(k)
        for arg in n.all_input_nodes:
            for k, _ in node_keys(arg):
                last_use[k] = max(last_use.get(k, i), i)
    frees: dict[int, list[int]] = {}
    for k, i in last_use.items():
        if k in external or k in outputs or (k in inputs and not free_inputs):
            continue
        frees.setdefault(i, []).append(k)
    live = sum(size[k] for k in inputs if k not in external)
    input_bytes = live
    peak, peak_node = live, "inputs"
    allocated: set[int] = set(inputs)
    total_alloc = 0
    for i, n in enumerate(nodes):
        if n.op in ("placeholder", "output"):
            pass
        else:
            for k, _ in node_keys(n):
                if k not in allocated and k not in external:
                    allocated.add(k)
                    live += size[k]
                    total_alloc += size[k]
            ws = op_workspace_bytes(n) if n.op == "call_function" else 0
            if live + ws > peak:
                peak, peak_node = live + ws, n.name
        for k in frees.get(i, ()):
            if k in allocated:
                live -= size[k]
                allocated.discard(k)
    out_bytes = sum(size[k] for k in outputs if k not in external and k in size)
    return Liveness(peak, peak_node, out_bytes, input_bytes, len(nodes), total_alloc)


def placeholder_keys(gm: fx.GraphModule) -> list[set[int]]:
    return [{k for k, _ in node_keys(n)} for n in gm.graph.nodes if n.op == "placeholder"]


def saved_activation_bytes(fw_gm: fx.GraphModule, num_user_outputs: int = 1, external: set[int] | None = None) -> int:
    """Bytes of distinct storages the forward returns for the backward (beyond its user outputs),
    excluding storages owned outside (parameters and their views, the batch)."""
    if external is None:
        external = set().union(*placeholder_keys(fw_gm))
    out = next(n for n in fw_gm.graph.nodes if n.op == "output")
    leaves = [a for a in pytree.tree_leaves(out.args[0]) if isinstance(a, fx.Node)]
    seen: dict[int, int] = {}
    for a in leaves[num_user_outputs:]:
        for k, b in node_keys(a):
            if k not in external:
                seen[k] = max(seen.get(k, 0), b)
    return sum(seen.values())


@dataclass
class MemoryEstimate:
    """Predicted peak bytes of one training step, by component (all in bytes)."""

    params: int
    grads: int
    optimizer_state: int
    inputs: int
    saved_activations: int
    forward_peak: int  # forward graph's own peak live bytes (includes saved activations so far)
    backward_peak: int  # backward graph's own peak live bytes (saved + temporaries + grads)
    optimizer_temp: int
    phase_totals: dict[str, int] = field(default_factory=dict)
    peak_node: dict[str, str] = field(default_factory=dict)

    @property
    def peak(self) -> int:
        return max(self.phase_totals.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phase_totals, key=self.phase_totals.__getitem__)

    @property
    def activations(self) -> int:
        """Peak bytes the graphs themselves hold (everything but persistent state)."""
        return (
            self.peak
            - self.params
            - self.optimizer_state
            - self.inputs
            - (self.grads if self.peak_phase == "optimizer" else 0)
        )

    def fits(self, budget_bytes: float) -> bool:
        return self.peak <= budget_bytes

    def __str__(self) -> str:
        rows = [
            ("parameters", self.params),
            ("gradients", self.grads),
            ("optimizer state", self.optimizer_state),
            ("batch inputs", self.inputs),
            ("saved activations", self.saved_activations),
            ("forward graph peak", self.forward_peak),
            ("backward graph peak", self.backward_peak),
            ("optimizer temporaries", self.optimizer_temp),
        ]
        lines = [f"predicted peak {self.peak / MiB:,.1f} MiB in {self.peak_phase}"]
        lines += [f"  {k:<22}{v / MiB:>10,.1f} MiB" for k, v in rows]
        lines += [
            f"  step phase {k:<11}{v / MiB:>10,.1f} MiB"
            + (f"  (at {self.peak_node[k]})" if k in self.peak_node else "")
            for k, v in self.phase_totals.items()
        ]
        return "\n".join(lines)


def predict_peak(
    fw_gm: fx.GraphModule,
    bw_gm: fx.GraphModule,
    n_params_bytes: int,
    *,
    optimizer: str = "adamw",
    num_user_outputs: int = 1,
    n_param_inputs: int | None = None,
    boxed_backward: bool = True,
    optimizer_temp_bytes: int | None = None,
    grads_kept: bool = False,
    batch_inputs: Iterable[int] | None = None,
) -> MemoryEstimate:
    """Predict a step's peak from AOTAutograd's partitioned graphs (nodes carry fake meta['val']).

    n_params_bytes: bytes of the trainable parameters (grads have the same size; AdamW/LAMB keep 2x).
    n_param_inputs: how many leading forward placeholders are parameters/buffers (the rest is
    the batch); None treats every forward input as a parameter or batch alike (both external).
    boxed_backward: the backward graph frees each saved activation at its last use.
    optimizer_temp_bytes: the optimizer's transient bytes (CPU AdamW runs per tensor, so about the
    largest parameter: frontend/capture.py's predict_for_model passes that; default here 1/8 of the parameters).
    grads_kept: gradients stay allocated through forward (zero_grad(set_to_none=False)).
    batch_inputs: indices of the forward placeholders that are the batch, when they are not simply the
    ones after the first n_param_inputs (a Dynamo graph orders its inputs by first use)."""
    ph = [n for n in fw_gm.graph.nodes if n.op == "placeholder"]
    keys = placeholder_keys(fw_gm)
    external = set().union(*keys) if keys else set()
    if batch_inputs is not None:
        batch_idx = sorted(set(batch_inputs))
    else:
        batch_idx = list(range(n_param_inputs, len(ph))) if n_param_inputs is not None else []
    batch_keys = set().union(*(keys[i] for i in batch_idx)) if batch_idx else set()
    batch_bytes = 0
    for i in batch_idx:
        batch_bytes += sum(b for k, b in node_keys(ph[i]) if k in batch_keys)
    fw = graph_liveness(fw_gm, external=external, free_inputs=False)
    saved = saved_activation_bytes(fw_gm, num_user_outputs, external)
    bw = graph_liveness(bw_gm, external=external, free_inputs=boxed_backward)
    opt_state = int(OPTIMIZER_STATE_FACTOR.get(optimizer.lower(), 2.0) * n_params_bytes)
    opt_temp = optimizer_temp_bytes if optimizer_temp_bytes is not None else n_params_bytes // 8
    grads = n_params_bytes
    g_fw = grads if grads_kept else 0
    base = n_params_bytes + opt_state + batch_bytes
    totals = {
        "forward": base + g_fw + fw.peak_bytes,
        "backward": base + g_fw + bw.peak_bytes,
        "optimizer": base + grads + opt_temp,
    }
    return MemoryEstimate(
        n_params_bytes,
        grads,
        opt_state,
        batch_bytes,
        saved,
        fw.peak_bytes,
        bw.peak_bytes,
        opt_temp,
        totals,
        {"forward": fw.peak_node, "backward": bw.peak_node},
    )


def param_bytes(params: Iterable[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for p in params:
        if p.requires_grad:
            p = p.to_local() if hasattr(p, "to_local") else p  # a tensor-parallel DTensor: this rank's shard
            seen[storage_key(p)] = storage_bytes(p)
    return sum(seen.values())
