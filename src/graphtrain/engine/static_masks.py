"""Attention masks that are constants of the graph, handed to SDPA as what they are: ``is_causal`` or no mask.

A model that builds its causal mask from the input's shape (``arange`` comparisons) hands SDPA a
[batch, 1, q, k] tensor whose value never changes. Hugging Face does so under any tracer: transformers 5 takes
its ``is_causal`` shortcut only when it can read the position ids to rule out packed sequences, which a tracer
cannot, so under Dynamo Llama and GPT-2 always pass a materialized mask (in eager they pass none). SDPA then
reads the mask for every score and computes every block above the diagonal. With ``is_causal`` aten's CPU
flash attention skips those blocks: 2-core Zen 4, fp32, [1, 16, 1024, 64], forward 30.8 against 21.7 ms,
backward 82 against 59 ms, outputs bitwise equal; at sequence 128 the gain is small (3.6 against 2.9 ms
forward at [8, 8, 128, 64]).

``specialize_static_masks(gm)`` runs on the Dynamo graph before anything else: for each SDPA call (in the
graph or in a repeated block's body, where the mask arrives as an input) whose mask depends on no graph input
and no random op, it evaluates the mask once (the arange/compare code Dynamo traced) and, when it is exactly
the causal pattern SDPA's ``is_causal`` means (attend to key j from query i iff j <= i) or attends everywhere,
rewrites the call to ``is_causal=True`` or no mask. A mask built from a user's ``attention_mask`` depends on
an input and is left alone. The rewrite is sound for as long as the graph is: the mask is a function of the
graph's static shapes, which Dynamo guards. Graphs with symbolic shapes (``engine.dynamic``) are left alone.
Switch: ``engine.static_masks``.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

_SDPA = tuple(f for f in (getattr(torch._C._nn, "scaled_dot_product_attention", None),
                          torch.nn.functional.scaled_dot_product_attention) if f is not None)
# Evaluating a mask materializes it once at compile time; bigger ones (2**26 bools = 64 MiB) are left as they are.
MAX_ELEMENTS = 1 << 26
_RANDOM = ("rand", "bernoulli", "dropout", "normal", "uniform", "multinomial", "poisson", "exponential")


def _is_sdpa(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target in _SDPA


def _arg(n: fx.Node, index: int, name: str, default: Any) -> Any:
    return n.args[index] if len(n.args) > index else n.kwargs.get(name, default)


def _set_arg(n: fx.Node, index: int, name: str, value: Any) -> None:
    if len(n.args) > index:
        args = list(n.args)
        args[index] = value
        n.args = tuple(args)
    else:
        n.update_kwarg(name, value)


def _example(n: Any) -> Any:
    return n.meta.get("example_value", n.meta.get("val")) if isinstance(n, fx.Node) else None


def _static_shape(t: Any) -> tuple[int, ...] | None:
    if not isinstance(t, torch.Tensor) or not all(type(d) is int for d in t.shape):
        return None
    return tuple(t.shape)


def _name(n: fx.Node) -> str:
    return n.target if isinstance(n.target, str) else str(getattr(n.target, "__name__", n.target))


def _mutates(n: fx.Node) -> bool:
    """An in-place op: ``operator.setitem`` or ``+=`` and kin, a torch function or tensor method named ``*_``
    (``operator.and_`` is ``&``, not in-place)."""
    if getattr(n.target, "__module__", None) in ("_operator", "operator"):
        return n.target is operator.setitem or n.target in _INPLACE_OPERATORS
    name = _name(n)
    return name.endswith("_") and not name.endswith("__")


_INPLACE_OPERATORS = {getattr(operator, f) for f in ("iadd", "iand", "iconcat", "ifloordiv", "ilshift", "imatmul",
                                                      "imod", "imul", "ior", "ipow", "irshift", "isub", "itruediv",
                                                      "ixor")}


def _ancestors(node: fx.Node) -> set[fx.Node] | None:
    """`node` and everything it reads, or None when any of it is a graph input, a module call or a random op, or
    when anything mutates one of them (a value computed before an in-place op is not the value read after)."""
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        if n.op in ("placeholder", "call_module", "output"):
            return None
        if n.op != "get_attr" and (any(r in _name(n).lower() for r in _RANDOM) or _mutates(n)):
            return None
        if any(_mutates(u) for u in n.users):
            return None
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def _evaluate(gm: fx.GraphModule, node: fx.Node) -> torch.Tensor | None:
    """The value of `node` when it is a constant of `gm` (reads no input), else None."""
    shape = _static_shape(_example(node))
    if shape is None or torch.Size(shape).numel() > MAX_ELEMENTS:
        return None
    nodes = _ancestors(node)
    if nodes is None:
        return None
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:  # in graph (topological) order
        if n in nodes:
            env[n] = g.node_copy(n, lambda x: env[x])
    g.output(env[node])
    try:
        with torch.no_grad():
            value = fx.GraphModule(gm, g)()
    except Exception:  # noqa: BLE001 - not evaluable here (e.g. another device): the mask stays a tensor
        return None
    return value if isinstance(value, torch.Tensor) else None


def mask_kind(mask: torch.Tensor, q_len: int | None, k_len: int | None) -> str | None:
    """"causal" when `mask` (as SDPA's attn_mask: bool, True attends; or additive float, 0 attends) is exactly
    ``is_causal``'s pattern for q_len queries and k_len keys in every batch and head; "full" when it attends
    everywhere; None otherwise (an additive mask must hold only 0 and -inf or the dtype's lowest value)."""
    if mask.dim() < 2:
        return None
    if mask.dtype == torch.bool:
        keep = mask
    elif mask.is_floating_point():
        lowest = torch.finfo(mask.dtype).min
        if not bool(((mask == 0) | (mask <= lowest)).all()):
            return None
        keep = mask == 0
    else:
        return None
    if bool(keep.all()):
        return "full"
    if q_len is None or k_len is None or tuple(keep.shape[-2:]) != (q_len, k_len):
        return None
    causal = torch.ones(q_len, k_len, dtype=torch.bool, device=keep.device).tril()
    return "causal" if bool((keep == causal).all()) else None


def constant_mask_kind(gm: fx.GraphModule, mask: fx.Node, q_len: int, k_len: int) -> str | None:
    """mask_kind of `mask` when it is a constant of `gm` (fuse_attention: the mask SDPA's decomposition builds for
    ``is_causal``, ``where(tril(ones), 0, -inf)``, becomes the fused op's is_causal again)."""
    value = _evaluate(gm, mask)
    return None if value is None else mask_kind(value, q_len, k_len)


def _seq_lens(sdpa: fx.Node) -> tuple[int | None, int | None]:
    q, k = _example(_arg(sdpa, 0, "query", None)), _example(_arg(sdpa, 1, "key", None))
    qs, ks = _static_shape(q), _static_shape(k)
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
    values: dict[fx.Node, torch.Tensor | None] = {}
    freed: set[fx.Node] = set()  # masks no longer read once their readers are rewritten

    def kind_of(outer: Any, q_len: int | None, k_len: int | None) -> str | None:
        if not isinstance(outer, fx.Node):
            return None
        if outer not in values:
            values[outer] = _evaluate(gm, outer)
        value = values[outer]
        kind = None if value is None else mask_kind(value, q_len, k_len)
        if kind:
            freed.add(outer)
        return kind

    done: dict[str, int] = {}
    for n in list(gm.graph.nodes):
        if _is_sdpa(n) and _rewritable(n) and (kind := kind_of(_arg(n, 3, "attn_mask", None), *_seq_lens(n))):
            _rewrite(n, kind)
            done[kind] = done.get(kind, 0) + 1
    for kind, count in _specialize_bodies(gm, kind_of).items():
        done[kind] = done.get(kind, 0) + count
    if done:
        _drop_dead(gm, freed)
    return [f"{count} SDPA call(s) with a constant {'causal' if kind == 'causal' else 'all-attending'} mask "
            f"(built from shapes, e.g. Hugging Face's under tracing): rewritten to "
            f"{'is_causal=True' if kind == 'causal' else 'no mask'} (engine.static_masks)"
            for kind, count in sorted(done.items())]


def _specialize_bodies(gm: fx.GraphModule, kind_of: Any) -> dict[str, int]:
    """Repeated-block bodies (engine/blocks.py): the mask is a body input; when every call of a body hands it the
    same kind of constant mask, the body gets a specialized copy without that input."""
    invoke = getattr(torch.ops.higher_order, "invoke_subgraph", None)
    calls: dict[str, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is invoke and n.args[0].op == "get_attr":
            calls.setdefault(n.args[1], []).append(n)
    done: dict[str, int] = {}
    for ident, group in calls.items():
        body: fx.GraphModule = getattr(gm, group[0].args[0].target)
        placeholders = [p for p in body.graph.nodes if p.op == "placeholder"]
        plan: dict[int, str] = {}
        for sdpa in (s for s in body.graph.nodes if _is_sdpa(s) and _rewritable(s)):
            mask = _arg(sdpa, 3, "attn_mask", None)
            if not isinstance(mask, fx.Node) or mask.op != "placeholder":
                continue
            i = placeholders.index(mask)
            found = {kind_of(c.args[2 + i], *_seq_lens(sdpa)) for c in group}
            if len(found) == 1 and None not in found:
                plan[i] = found.pop()
        if not plan:
            continue
        new = fx.GraphModule(body, _copy_graph(body.graph))
        new_placeholders = [p for p in new.graph.nodes if p.op == "placeholder"]
        for sdpa in [s for s in new.graph.nodes if _is_sdpa(s)]:
            mask = _arg(sdpa, 3, "attn_mask", None)
            if isinstance(mask, fx.Node) and mask in new_placeholders and new_placeholders.index(mask) in plan:
                kind = plan[new_placeholders.index(mask)]
                _rewrite(sdpa, kind)
                done[kind] = done.get(kind, 0) + len(group)
        unused = sorted(i for i in plan if not new_placeholders[i].users)
        for i in unused:
            new.graph.erase_node(new_placeholders[i])
        new.recompile()
        name = _free_attr(gm, f"{group[0].args[0].target}_static_mask")
        gm.add_submodule(name, new)
        new_ident = f"{ident}_static_mask"
        for c in group:
            with gm.graph.inserting_before(c):
                attr = gm.graph.get_attr(name)
            operands = [a for j, a in enumerate(c.args[2:]) if j not in unused]
            c.args = (attr, new_ident, *operands)
    return done


def _copy_graph(graph: fx.Graph) -> fx.Graph:
    g = fx.Graph()
    out = g.graph_copy(graph, {})
    g.output(out)
    return g


def _free_attr(gm: fx.GraphModule, base: str) -> str:
    name, k = base, 0
    while hasattr(gm, name):
        k += 1
        name = f"{base}_{k}"
    return name


def _drop_dead(gm: fx.GraphModule, freed: set[fx.Node]) -> None:
    """Erase what only fed the rewritten masks (their ancestors: pure tensor code reading no input, checked by
    _ancestors) and the body attributes no call reads any more."""
    dead = set().union(*(_ancestors(n) or set() for n in freed))
    for n in reversed(list(gm.graph.nodes)):
        if not n.users and (n in dead or (n.op == "get_attr" and isinstance(getattr(gm, n.target, None),
                                                                            fx.GraphModule))):
            gm.graph.erase_node(n)
    gm.graph.lint()
    gm.recompile()
