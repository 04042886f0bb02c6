"""Repeated blocks, the Dynamo side (before capture): ``mark_repeated_blocks(module)`` wraps the forward of every
block of a repeated stack (an ``nn.ModuleList`` of two or more modules of one class with the same parameter shapes:
GPT-2's ``h``, BERT's ``encoder.layer``, Llama's ``layers``, ViT's ``encoder.layer``) in
``torch.compiler.nested_compile_region``. Dynamo then traces the block once and stamps out an ``invoke_subgraph``
call per layer on one shared body, guarded like any Dynamo graph: a block whose inputs differ (shape, dtype, a flag)
gets its own body, so reuse is never unsafe. In eager PyTorch the wrapper is a no-op. pipeline/blocks.py compiles
the graph Dynamo then hands over, piece by piece.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphtrain.config.torch_compat import regions_take_dtensors
from graphtrain.pipeline.trace import dtensor_inputs

_MARK = "_graphtrain_block_forward"
_REGION_FRAME = "block_forward"  # _region's wrapper as Dynamo's "from user code" stacks name it (its code's name)


def repeated_blocks(module: torch.nn.Module) -> list[tuple[str, list[torch.nn.Module]]]:
    """The repeated stacks of `module`: (name, blocks) for each group of >= 2 modules of one class with the same
    parameter and buffer shapes in an ``nn.ModuleList``, when the group holds at least half of the list; outermost
    only (a stack inside a block is the block's). The name is the ModuleList's, or ``list[i, j, ...]`` when the
    group is not the whole list: T5's first block alone carries the relative-position bias, so its other blocks
    repeat and block 0 runs in the graph before them (one graph for the whole model before)."""
    found: list[tuple[str, list[torch.nn.Module]]] = []
    for name, child in module.named_modules():
        if not isinstance(child, torch.nn.ModuleList) or len(child) < 2:
            continue
        if any(name.startswith(f"{outer.split('[')[0]}.") for outer, _ in found):
            continue
        groups: dict[tuple[Any, ...], list[int]] = {}
        for i, b in enumerate(child):
            if not isinstance(b, torch.nn.ModuleList):
                groups.setdefault((type(b), _signature(b)), []).append(i)
        for idx in groups.values():
            if len(idx) >= 2 and 2 * len(idx) >= len(child):
                label = name if len(idx) == len(child) else f"{name}[{', '.join(map(str, idx))}]"
                found.append((label, [child[i] for i in idx]))
    return found


def _signature(block: torch.nn.Module) -> tuple[Any, ...]:
    return tuple((n, tuple(t.shape), t.dtype) for n, t in [*block.named_parameters(), *block.named_buffers()])


def whole_model_reason(config: Any) -> str:
    """Why `config` needs the model as one graph ("" when blocks may compile one by one): recompute full and
    auto decide per layer over the whole model (which layers to checkpoint, what fits the memory budget), so
    their partitioner must see every layer at once."""
    if config.recompute in ("full", "auto"):
        return f"engine.recompute={config.recompute} decides over all layers at once"
    return ""


def splits_into_blocks(config: Any, module: torch.nn.Module) -> bool:
    """Whether `accelerate` compiles `module` block by block under engine `config`: compile_blocks on, nothing that
    needs the model as one graph (whole_model_reason), and a repeated stack to split at that carries no hooks."""
    return bool(config.compile_blocks and not whole_model_reason(config) and markable_blocks(module))


def markable_blocks(module: torch.nn.Module) -> list[tuple[str, list[torch.nn.Module]]]:
    """The repeated stacks ``mark_repeated_blocks`` marks: those whose blocks carry no forward (pre-)hook, and no
    DTensor parameter where Dynamo cannot trace a region of them (config/torch_compat.py); none on a torch without
    ``nested_compile_region``."""
    if not hasattr(torch.compiler, "nested_compile_region"):
        return []
    dtensors_ok = regions_take_dtensors()
    return [
        (name, blocks)
        for name, blocks in repeated_blocks(module)
        if not any(b._forward_hooks or b._forward_pre_hooks for b in blocks)
        and (dtensors_ok or not dtensor_inputs([p for b in blocks for p in b.parameters()]))
    ]


def mark_repeated_blocks(module: torch.nn.Module) -> list[str]:
    """Wrap each repeated block's forward in ``nested_compile_region`` (once; blocks with hooks are left alone,
    since a region covers ``forward`` only and hooks would then run between traced pieces). Returns the names of
    the stacks marked, e.g. ``["transformer.h (12 x GPT2Block)"]``."""
    marked = []
    for name, blocks in markable_blocks(module):
        region = _region(type(blocks[0]).forward, len(blocks))
        for block in blocks:
            if getattr(block, _MARK, False):
                continue
            block.forward = types.MethodType(region, block)
            setattr(block, _MARK, True)
        marked.append(f"{name} ({len(blocks)} x {type(blocks[0]).__name__})")
    return marked


def unmark_repeated_blocks(module: torch.nn.Module) -> None:
    """Undo ``mark_repeated_blocks``: every marked block of `module` runs its class's forward again (inlined into
    the graphs around it by Dynamo)."""
    for block in module.modules():
        if block.__dict__.pop(_MARK, False):
            block.__dict__.pop("forward", None)


def region_refused(e: BaseException) -> str | None:
    """Why Dynamo refused a marked block's region, if that is what `e` (a failed call) comes from, else None.

    Dynamo traces a region's body whole or not at all: a graph break inside a block (a data-dependent branch, a
    ``.item()``, a print, a hook whose code Dynamo cannot trace) fails the capture of the whole call with
    ``UncapturedHigherOrderOpError``, where plain torch.compile splits the graph at the break and goes on. Other
    higher-order operators (cond, map, scan) fail the same way without regions, so a chain that names one of
    them is not ours. Also any other Dynamo error raised while tracing a region (its user stack passes through
    the region's wrapper): torch 2.11's region tracing fails on an autograd.Function inside a block ("KeyError:
    example_value"), which it traces inline."""
    while e is not None:
        if type(e).__name__ == "UncapturedHigherOrderOpError":
            hop = str(getattr(e, "_hop_name", ""))  # torch 2.13: "torch.ops.higher_order.invoke_subgraph"
            if hop and not hop.endswith("invoke_subgraph"):  # (absent on older torches)
                return None
            return " ".join(str(e).split()).partition("Got graph break/error: ")[2][:240] or type(e).__name__
        dynamo_error = any(c.__name__ == "TorchDynamoException" for c in type(e).__mro__)
        if dynamo_error and f"in {_REGION_FRAME}" in str(e):
            return " ".join(f"{type(e).__name__}: {e}".split())[:240]
        e = getattr(e, "inner_exception", None) or e.__cause__  # type: ignore[assignment]
    return None


def _region(forward: Callable[..., Any], n_blocks: int) -> Callable[..., Any]:
    """The block's forward for Dynamo: its arguments flattened to leaves, then ``nested_compile_region`` with room
    for one reuse entry per block (under ``no_subgraph_reuse`` Dynamo traces every block call and records an entry
    for each; torch 2.13's default limit of 8 then failed the capture of any model with more than 8 blocks: a
    24-layer reference GPT-2 with dropout, "exceeded maximum reuse entries").

    Why flatten: to reuse a traced block Dynamo fingerprints the call's arguments. Keyword arguments, or a tuple
    among them (Llama's ``position_embeddings``), send it through ``pytree.tree_flatten`` traced symbolically: 20 ms
    per block call, 0.45 s of a 24-layer Hugging Face GPT-2's 3 s capture (2-core Zen 4, torch 2.13). Flat
    positional leaves (tensors, constants, the module) take its fast path. The flattening here is plain Python that
    Dynamo folds away; ``spec`` (a string constant, so part of the fingerprint) says how to rebuild the call. Calls
    with other argument kinds (a KV-cache object) keep the structured call. In eager PyTorch this is the forward."""
    import inspect

    kw: dict[str, Any] = (
        {"max_reuse_entries": max(8, 2 * n_blocks)}
        if "max_reuse_entries" in inspect.signature(torch.compiler.nested_compile_region).parameters
        else {}
    )
    structured = torch.compiler.nested_compile_region(forward, **kw)

    def flat_body(self: Any, spec: str, *leaves: Any) -> Any:
        args, kwargs = _unflatten_call(spec, leaves)
        return _unalias(forward(self, *args, **kwargs), leaves)

    flat = torch.compiler.nested_compile_region(flat_body, **kw)

    @functools.wraps(forward)
    def block_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():
            return forward(self, *args, **kwargs)
        if any("," in k or "*" in k for k in kwargs):  # a name the spec cannot carry (only from **{...})
            return structured(self, *args, **kwargs)
        spec, leaves = _flatten_call(args, kwargs)
        return flat(self, spec, *leaves)

    return block_forward


def _unalias(out: Any, leaves: Sequence[Any]) -> Any:
    """`out` with every tensor that is one of the block's own inputs replaced by a copy. A compiled region may not
    return an input (Dynamo refuses the aliasing), and T5's blocks hand back the position bias they were given; the
    copy is that bias, [1, heads, S, S], once per block. Only a tensor or a flat tuple/list of outputs is looked at
    (what Hugging Face blocks return): a general pytree walk would be traced per block call (see _region)."""
    ins = [x for x in leaves if isinstance(x, torch.Tensor)]

    def fix(t: Any) -> Any:
        return t.clone() if isinstance(t, torch.Tensor) and any(t is x for x in ins) else t

    if isinstance(out, (tuple, list)) and not hasattr(out, "_fields"):
        return type(out)(fix(t) for t in out)
    return fix(out)


def _flatten_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, list[Any]]:
    """(spec, leaves): the spec names each argument ("" positional, else its keyword) with ``*N`` after a tuple of N,
    whose items become leaves of their own. Kept to a few bytecodes: Dynamo traces it at every block call."""
    names: list[str] = []
    leaves: list[Any] = []
    for name, value in zip(("",) * len(args) + tuple(kwargs), (*args, *kwargs.values())):
        if type(value) is tuple:
            names.append(f"{name}*{len(value)}")
            leaves.extend(value)
        else:
            names.append(name)
            leaves.append(value)
    return ",".join(names), leaves


def _unflatten_call(spec: str, leaves: Sequence[Any]) -> tuple[list[Any], dict[str, Any]]:
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    i = 0
    for item in spec.split(",") if spec or leaves else []:
        name, star, count = item.partition("*")
        n = int(count) if star else 1
        value = tuple(leaves[i : i + n]) if star else leaves[i]
        i += n
        if name:
            kwargs[name] = value
        else:
            args.append(value)
    return args, kwargs


class ReuseMisbound(RuntimeError):
    """Dynamo stamped out a block's traced body for another block but kept the first block's weights."""


@contextlib.contextmanager
def no_subgraph_reuse() -> Any:
    """Dynamo traces every block call instead of stamping out a traced one (identical bodies are still
    deduplicated after tracing, so they still compile once). Measured with torch 2.13: stamping out is what makes
    tracing cheap (0.08 s instead of 0.26 s per GPT-2 block, 2-core AVX2 EPYC), but on a block called from a
    plain ``for block in self.blocks`` loop it binds every call to the first block's parameters; compile_by_blocks
    detects that (ReuseMisbound) and the capture is redone under this context."""
    try:
        mod = importlib.import_module("torch._dynamo.variables.invoke_subgraph")
    except ImportError:  # torch 2.11: no reuse of traced blocks to switch off
        yield
        return
    original = getattr(mod, "has_reuse_entries", None)
    if original is None:
        yield
        return
    mod.__dict__["has_reuse_entries"] = lambda *args, **kwargs: False  # (a module attribute mypy does not know)
    try:
        yield
    finally:
        mod.__dict__["has_reuse_entries"] = original
