"""A no_grad region inside a training graph, rewritten so that the pre-autodiff passes can run on the graph.

Dynamo records ``with torch.no_grad():`` inside a traced function as ``torch._C._set_grad_enabled(False)`` ...
``_set_grad_enabled(True)`` nodes. graphtrain's trace to aten and its pre-autodiff passes assume one grad mode
for the whole graph, so a graph with such a region used to skip every pass. Hugging Face Llama computes its rotary
embedding's cos/sin under no_grad: compiled as one graph (recompute full/auto, or no repeated blocks), the whole
model lost its fusions, the fused LM head and loss included (its peak under recompute auto was above no
recompute's: 3003 against 2156 MiB, 4 layers, vocabulary 32000, batch 16 x 256).

Rewrite (``lift_no_grad_regions``): the two grad-mode nodes go, and every value the region computes for later
use passes through ``detach``. The values are the same: an op under no_grad computes what it computes with grad
on, and its result does not require grad, as a detached one does not. Applied only where that argument holds:

- the graph runs with grad enabled (a training graph) and every region is one ``False`` ... ``True`` pair;
- nothing in a region mutates (an in-place method or op, ``copy_``, ``out=``): under no_grad a parameter may be
  updated in place, with grad on that is an error or a different autograd graph;
- no module calls or nested grad-mode changes inside a region.

Anything else keeps the old behaviour (the graph goes to AOTAutograd as captured, passes skipped, reported).
The pass ``lift_no_grad_regions`` (stage ``dynamo``) runs it on every Dynamo graph compiled with grad enabled.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from graphtrain.passes.manager import PassContext, register_pass


@register_pass("dynamo", phase="grad")
def lift_no_grad_regions_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """`lift_no_grad_regions` on a Dynamo graph compiled with grad enabled (a graph without grad-mode changes has no
    regions: nothing to do); counts the regions lifted. Switched off, such a graph skips the pre-autodiff passes."""
    if torch.is_grad_enabled() and (lifted := lift_no_grad_regions(gm)):
        ctx.count(lifted)
        ctx.tell(
            f"{lifted} no_grad region{'s' * (lifted > 1)} in a graph: lifted (its values detached) so that the "
            f"pre-autodiff passes run"
        )
    return gm


def _grad_mode(n: fx.Node) -> bool | None:
    if n.op == "call_function" and n.target is torch._C._set_grad_enabled and len(n.args) == 1 and not n.kwargs:
        return bool(n.args[0])
    return None


def _mutates(n: fx.Node) -> bool:
    if "out" in n.kwargs:
        return True
    t = n.target
    if n.op == "call_method":
        return isinstance(t, str) and t.endswith("_") and not t.startswith("__")
    if n.op == "call_function":
        if isinstance(t, torch._ops.OpOverload):
            return t._schema.is_mutable
        if isinstance(t, torch._ops.OpOverloadPacket):
            return any(getattr(t, o)._schema.is_mutable for o in t.overloads())
        name = getattr(t, "__name__", "")
        if t in (
            operator.setitem,
            operator.iadd,
            operator.isub,
            operator.imul,
            operator.itruediv,
            operator.iand,
            operator.ior,
        ):
            return True
        return name.endswith("_") and not name.startswith("__")
    return n.op != "get_attr"  # call_module and anything unknown: not proven safe


def no_grad_regions(gm: fx.GraphModule) -> list[list[fx.Node]] | None:
    """The nodes of each ``_set_grad_enabled(False)`` ... ``(True)`` region of `gm` (the grad-mode nodes included,
    first and last), or None when the graph's grad-mode changes are not such pairs."""
    regions, current = [], None
    for n in gm.graph.nodes:
        mode = _grad_mode(n)
        if n.op == "call_function" and n.target is torch._C._set_grad_enabled and mode is None:
            return None
        if mode is False:
            if current is not None:
                return None
            current = [n]
        elif mode is True:
            if current is None:
                return None
            current.append(n)
            regions.append(current)
            current = None
        elif current is not None:
            if n.op == "output":
                return None
            current.append(n)
    return None if current is not None else regions


def lift_no_grad_regions(gm: fx.GraphModule) -> int:
    """Rewrite `gm` in place (see the module docstring); returns how many regions were lifted, 0 when there were
    none or the rewrite does not apply (then `gm` is unchanged). Call with grad mode enabled only."""
    regions = no_grad_regions(gm)
    if not regions or any(_mutates(n) for r in regions for n in r[1:-1]):
        return 0
    escaping = []  # (node, its users after the region): the values the region computes for later use
    for r in regions:
        inside = set(r)
        for n in r[1:-1]:
            outside = [u for u in n.users if u not in inside]
            if not outside:
                continue
            val = n.meta.get("example_value")
            if isinstance(val, torch.Tensor):
                escaping.append((r, n, outside))
            elif not _no_tensor(val):  # a tuple of tensors leaving the region (Dynamo gives getitems): left alone
                return 0
    g = gm.graph
    for r, n, outside in escaping:
        with g.inserting_after(r[-1]):
            det = g.call_method("detach", (n,))
        det.meta["example_value"] = n.meta["example_value"]
        for u in outside:
            u.replace_input_with(n, det)
    for r in regions:
        g.erase_node(r[0])
        g.erase_node(r[-1])
    g.lint()
    gm.recompile()
    return len(regions)


def _no_tensor(v: object) -> bool:
    if isinstance(v, torch.Tensor):
        return False
    if isinstance(v, (tuple, list)):
        return all(_no_tensor(x) for x in v)
    return True
