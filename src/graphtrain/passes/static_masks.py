"""Attention masks that are constants of the graph, handed to SDPA as what they are: ``is_causal`` or no mask.

A model that builds its causal mask from the input's shape (``arange`` comparisons) hands SDPA a
[batch, 1, q, k] tensor whose value never changes. Hugging Face does so under any tracer: transformers 5 takes
its ``is_causal`` shortcut only when it can read the position ids to rule out packed sequences, which a tracer
cannot, so under Dynamo Llama and GPT-2 always pass a materialized mask (in eager they pass none). SDPA then
reads the mask for every score and computes every block above the diagonal. With ``is_causal`` aten's CPU
flash attention skips those blocks: 2-core Zen 4, fp32, [1, 16, 1024, 64], forward 30.8 against 21.7 ms,
backward 82 against 59 ms, outputs bitwise equal; at sequence 128 the gain is small (3.6 against 2.9 ms
forward at [8, 8, 128, 64]).

``specialize_static_masks(gm)`` runs on the Dynamo graph first (runtime/backend.py): for each SDPA call (in the
graph or in a repeated block's body, where the mask arrives as an input) whose mask depends on no graph input
and no random op, it evaluates the mask once (the arange/compare code Dynamo traced) and, when it is exactly
the causal pattern SDPA's ``is_causal`` means (attend to key j from query i iff j <= i) or attends everywhere,
rewrites the call to ``is_causal=True`` or no mask. A mask built from a user's ``attention_mask`` depends on
an input and is left alone. The rewrite is sound for as long as the graph is: the mask is a function of the
graph's static shapes, which Dynamo guards. Graphs with symbolic shapes (``engine.dynamic``) are left alone.
Switch: ``engine.static_masks``, or the pass by name (``engine.passes: {specialize_static_masks: false}``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from graphtrain.passes.graph_utils import (
    arg_node,
    constant_ancestors,
    constant_value,
    copy_graph,
    example_value,
    mask_kind,
    static_shape,
)
from graphtrain.passes.graph_utils import call_arg as _arg
from graphtrain.passes.graph_utils import is_sdpa_call as _is_sdpa
from graphtrain.passes.manager import PassContext, register_pass


@register_pass("dynamo", phase="masks")
def specialize_static_masks_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """The Dynamo graph's constant causal or all-attending SDPA masks as ``is_causal=True`` or no mask (module
    docstring); counts the SDPA calls rewritten (a block body's once per call of it). Does nothing under
    ``engine.static_masks: false`` or ``engine.dynamic``."""
    if not ctx.config.static_masks or ctx.config.dynamic:
        return gm
    done = _specialize(gm)
    for kind, count in sorted(done.items()):
        ctx.count(count)
        ctx.note(f"{count} {'causal mask(s) -> is_causal' if kind == 'causal' else 'all-attending mask(s) -> none'}")
        ctx.tell(_line(kind, count))
    return gm


def _set_arg(n: fx.Node, index: int, name: str, value: Any) -> None:
    if len(n.args) > index:
        args = list(n.args)
        args[index] = value
        n.args = tuple(args)
    else:
        n.update_kwarg(name, value)


def _seq_lens(sdpa: fx.Node) -> tuple[int | None, int | None]:
    q, k = example_value(_arg(sdpa, 0, "query", None)), example_value(_arg(sdpa, 1, "key", None))
    qs, ks = static_shape(q), static_shape(k)
    return (qs[-2] if qs else None), (ks[-2] if ks else None)


def _rewrite(sdpa: fx.Node, kind: str) -> None:
    _set_arg(sdpa, 3, "attn_mask", None)
    if kind == "causal":
        _set_arg(sdpa, 5, "is_causal", True)


def _rewritable(sdpa: fx.Node) -> bool:
    return not _arg(sdpa, 5, "is_causal", False)  # a mask with is_causal is SDPA's error to raise


def specialize_static_masks(gm: fx.GraphModule) -> list[str]:
    """Rewrite SDPA calls whose mask is a constant causal or all-attending pattern (module docstring). Returns one
    line per kind of rewrite, for the report's notes."""
    return [_line(kind, count) for kind, count in sorted(_specialize(gm).items())]


def _line(kind: str, count: int) -> str:
    return (
        f"{count} SDPA call(s) with a constant {'causal' if kind == 'causal' else 'all-attending'} mask "
        f"(built from shapes, e.g. Hugging Face's under tracing): rewritten to "
        f"{'is_causal=True' if kind == 'causal' else 'no mask'} (engine.static_masks)"
    )


def _specialize(gm: fx.GraphModule) -> dict[str, int]:
    """The rewrite: how many SDPA calls of each kind of mask (graph_utils.mask_kind: "causal", "full") it rewrote."""
    values: dict[fx.Node, torch.Tensor | None] = {}
    kinds: dict[tuple[fx.Node, int | None, int | None], str | None] = {}  # every block call reads the same mask
    freed: set[fx.Node] = set()  # masks no longer read once their readers are rewritten

    def kind_of(outer: Any, q_len: int | None, k_len: int | None) -> str | None:
        if not isinstance(outer, fx.Node):
            return None
        key = (outer, q_len, k_len)
        if key not in kinds:
            if outer not in values:
                values[outer] = constant_value(gm, outer)
            value = values[outer]
            kinds[key] = None if value is None else mask_kind(value, q_len, k_len)
        if kinds[key]:
            freed.add(outer)
        return kinds[key]

    done: dict[str, int] = {}
    for n in list(gm.graph.nodes):
        if _is_sdpa(n) and _rewritable(n) and (kind := kind_of(_arg(n, 3, "attn_mask", None), *_seq_lens(n))):
            _rewrite(n, kind)
            done[kind] = done.get(kind, 0) + 1
    for kind, count in _specialize_bodies(gm, kind_of).items():
        done[kind] = done.get(kind, 0) + count
    if done:
        _drop_dead(gm, freed)
    return done


def _specialize_bodies(gm: fx.GraphModule, kind_of: Any) -> dict[str, int]:
    """Repeated-block bodies (pipeline/blocks.py): the mask is a body input; when every call of a body hands it the
    same kind of constant mask, the body gets a specialized copy without that input."""
    invoke = getattr(torch.ops.higher_order, "invoke_subgraph", None)
    calls: dict[str, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if (
            n.op == "call_function"
            and n.target is invoke
            and (attr := arg_node(n, 0)) is not None
            and attr.op == "get_attr"
        ):
            calls.setdefault(n.args[1], []).append(n)
    done: dict[str, int] = {}
    for ident, group in calls.items():
        head = arg_node(group[0], 0)
        assert head is not None  # the loop above kept only calls whose first argument is a get_attr node
        body_attr = str(head.target)
        body: fx.GraphModule = getattr(gm, body_attr)
        placeholders = [p for p in body.graph.nodes if p.op == "placeholder"]
        plan: dict[int, tuple[int, str]] = {}  # the SDPA's position among the body's nodes -> (mask input, kind)
        for pos, sdpa in enumerate(body.graph.nodes):
            mask = _arg(sdpa, 3, "attn_mask", None) if _is_sdpa(sdpa) and _rewritable(sdpa) else None
            if not isinstance(mask, fx.Node) or mask.op != "placeholder":
                continue
            i = placeholders.index(mask)
            found = {kind_of(c.args[2 + i], *_seq_lens(sdpa)) for c in group}  # per SDPA: its own q and k lengths
            if len(found) == 1 and None not in found:
                plan[pos] = (i, found.pop())
        if not plan:
            continue
        new = copy_graph(body)
        new_placeholders = [p for p in new.graph.nodes if p.op == "placeholder"]
        for pos, sdpa in enumerate(list(new.graph.nodes)):  # graph_copy keeps the order
            if pos in plan:
                _rewrite(sdpa, plan[pos][1])
                done[plan[pos][1]] = done.get(plan[pos][1], 0) + len(group)
        # an input no longer read (every SDPA reading it rewritten) leaves the body and its calls
        unused = sorted({i for i, _ in plan.values() if not new_placeholders[i].users})
        for i in unused:
            new.graph.erase_node(new_placeholders[i])
        new.recompile()
        name = _free_attr(gm, f"{body_attr}_static_mask")
        gm.add_submodule(name, new)
        new_ident = f"{ident}_static_mask"
        for c in group:
            with gm.graph.inserting_before(c):
                attr = gm.graph.get_attr(name)
            operands = [a for j, a in enumerate(c.args[2:]) if j not in unused]
            c.args = (attr, new_ident, *operands)
    return done


def _free_attr(gm: fx.GraphModule, base: str) -> str:
    name, k = base, 0
    while hasattr(gm, name):
        k += 1
        name = f"{base}_{k}"
    return name


def _drop_dead(gm: fx.GraphModule, freed: set[fx.Node]) -> None:
    """Erase what only fed the rewritten masks (their ancestors: pure tensor code reading no input, checked by
    constant_ancestors) and the body attributes no call reads any more."""
    dead = set().union(*(constant_ancestors(n) or set() for n in freed))
    for n in reversed(list(gm.graph.nodes)):
        if not n.users and (
            n in dead or (n.op == "get_attr" and isinstance(getattr(gm, n.target, None), fx.GraphModule))
        ):
            gm.graph.erase_node(n)
    gm.graph.lint()
    gm.recompile()
