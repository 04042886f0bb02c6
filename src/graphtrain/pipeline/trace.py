"""Trace a forward function to graphtrain's pre-autodiff IR.

The IR: a functional aten-level FX graph (no in-place ops; views kept), traced with fake tensors,
parameters and buffers as ordinary placeholders, every node carrying ``meta["val"]`` (a fake
tensor with shape and dtype). Pre-autodiff passes and fusion patterns are written against it, and
AOTAutograd builds the gradient graph from it.
"""

from __future__ import annotations

import contextlib
import copy
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import statically_known_true as known

from graphtrain.config.torch_compat import compiling_flag
from graphtrain.passes.graph_utils import is_symbolic


def trace_aten_forward(fn: Callable[..., Any], example_inputs: Sequence[Any]) -> fx.GraphModule:
    """Trace `fn(*example_inputs)` (no autograd recorded) into the functional aten forward IR."""
    fake_mode = detect_fake_mode(example_inputs)
    # differentiated later: an input or a parameter of its own (a graph that holds its weights) requires grad
    needs_grad = any(isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs) or (
        isinstance(fn, torch.nn.Module) and any(p.requires_grad for p in fn.parameters())
    )
    gm_in = None
    if isinstance(fn, fx.GraphModule):
        # Run the Dynamo graph node by node with node meta preserved, so each aten node keeps the
        # nn_module_stack of the node it came from (recompute=full finds the model's layers by it).
        gm_in = fn
        fn = lambda *a: fx.Interpreter(gm_in).run(*a)  # noqa: E731
    if fake_mode is None:
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        inputs = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    else:  # inside a Dynamo backend: reuse its fake mode (and shape env), as AOTAutograd does
        inputs = fakify_like_dynamo(fake_mode, example_inputs)
    dispatcher: contextlib.AbstractContextManager[Any]
    if any(is_symbolic(x) for x in inputs) or _runs_functorch_transforms(gm_in):
        from torch._dispatch.python import enable_python_dispatcher

        functional, dispatcher = _dispatch_functionalize(fn), enable_python_dispatcher()
    else:
        functional, dispatcher = torch.func.functionalize(fn, remove="mutations"), contextlib.nullcontext()
    # compiling_flag: as under torch.export, library code sees a trace and takes its traceable branches (HF BART's
    # mask helper read the padding mask's values, which a fake tensor has not: the step fell back uncompiled)
    with fake_mode, torch.no_grad(), fx.traceback.preserve_node_meta(), dispatcher, compiling_flag():
        gm = make_fx(functional, tracing_mode="real", pre_dispatch=False)(*inputs)
    if needs_grad:
        keep_attention_logsumexp(gm, fake_mode)
        differentiable_copies(gm, fake_mode)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def trace_step(fn: Callable[..., Any], fake_args: Sequence[Any], fake_mode: FakeTensorMode) -> fx.GraphModule:
    """`fn(*fake_args)` traced as it runs, in `fake_mode` (the mode `fake_args` were made in): autograd calls and
    in-place updates included, no functionalization. A whole training step (frontend/compile_step.py: forward,
    ``torch.autograd.grad``, the optimizer's update) becomes one FX graph that writes its state inputs in place."""
    with fake_mode:
        return make_fx(fn, tracing_mode="real")(*fake_args)


_SCATTERS = frozenset(
    getattr(torch.ops.aten, name).default
    for name in ("slice_scatter", "select_scatter", "diagonal_scatter", "as_strided_scatter")
)


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape and the same strides on every dim of size over 1 (a size-1 dim's stride is never read); known
    without a guard (under dynamic shapes a comparison that needs one counts as different)."""
    if a.dim() != b.dim() or not all(known(x == y) for x, y in zip(a.shape, b.shape)):
        return False
    return all(known(n <= 1) or known(sa == sb) for n, sa, sb in zip(a.shape, a.stride(), b.stride()))


def differentiable_copies(gm: fx.GraphModule, fake_mode: FakeTensorMode) -> int:
    """Give each functional ``aten.copy(self, src)`` as the ops it stands for: `src` cast to self's dtype, broadcast
    to self's shape, cloned; returns how many nodes changed.

    Functionalization turns an in-place copy into a view (``x[..., :n].copy_(y)``, HF DeepSeek-V3's keys built in a
    new tensor) into ``aten.copy`` and a scatter. Autograd has no formula for the functional ``aten.copy``, so
    AOTAutograd's trace of this IR raised "derivative for aten::copy is not implemented" and the graph ran eagerly.
    The ops below compute the same values and have formulas: the gradient reaches `src` (summed over the broadcast
    dims, cast back) and not `self`, whose values the copy overwrote, as eager's ``copy_`` gives; the clone is laid
    out as the copy's result (in the order of its strides). A copy whose result would still be laid out otherwise
    (unless only a scatter reads it), or that moves between devices, is left as it is."""
    aten, changed = torch.ops.aten, 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.copy.default:
            continue
        dst, src = node.args[0], node.args[1]
        dv, sv, out = dst.meta.get("val"), getattr(src, "meta", {}).get("val"), node.meta.get("val")
        if not (isinstance(dv, torch.Tensor) and isinstance(sv, torch.Tensor) and isinstance(out, torch.Tensor)):
            continue
        if sv.device != dv.device:
            continue
        made: list[fx.Node] = []
        with gm.graph.inserting_before(node):
            x = src
            if sv.dtype != dv.dtype:
                made.append(x := gm.graph.call_function(aten._to_copy.default, (x,), {"dtype": dv.dtype}))
            if tuple(sv.shape) != tuple(dv.shape):
                made.append(x := gm.graph.call_function(aten.expand.default, (x, list(dv.shape))))
            # the copy's result is laid out as `self` (a transposed view: HF Qwen3-Next's chunked attention writes
            # its output by chunks into one): the clone in that dims order, seen back in the copy's
            # (on concrete strides only: ordering symbolic ones would guard on them, a recompile at each new length)
            strides = out.stride()
            concrete = all(isinstance(st, int) for st in strides)
            order = sorted(range(out.dim()), key=lambda d: -int(strides[d])) if concrete else list(range(out.dim()))
            permuted = order != sorted(order)
            if permuted:
                made.append(x := gm.graph.call_function(aten.permute.default, (x, order)))
            made.append(
                x := gm.graph.call_function(aten.clone.default, (x,), {"memory_format": torch.contiguous_format})
            )
            if permuted:
                back = sorted(range(out.dim()), key=order.__getitem__)
                made.append(x := gm.graph.call_function(aten.permute.default, (x, back)))
        with fake_mode:
            for n in made:
                args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: a.meta.get("val"))
                op: Any = n.target
                n.meta["val"] = op(*args, **kwargs)
        # functionalization writes the copy back with a scatter, which reads its values, not their layout
        scattered = all(u.op == "call_function" and u.target in _SCATTERS for u in node.users)
        if not _same_layout(x.meta["val"], out) and not scattered:
            for n in reversed(made):
                gm.graph.erase_node(n)
            continue
        x.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        node.replace_all_uses_with(x)
        gm.graph.erase_node(node)
        changed += 1
    return changed


def keep_attention_logsumexp(gm: fx.GraphModule, fake_mode: FakeTensorMode) -> int:
    """Set compute_log_sumexp back on the SDPA kernels that have the flag; returns how many nodes changed.

    On CUDA, scaled_dot_product_attention's efficient and cuDNN kernels return the logsumexp their backward reads
    only when asked, and SDPA asks only when grad is enabled and an input requires grad. The trace above runs under
    no_grad, so it records compute_log_sumexp=False; AOTAutograd then differentiates that node and its backward gets
    a [B, H, 0] logsumexp (head stride 1), which the CUDA kernel rejects: "LSE is not correctly aligned (strideH)"
    (issue #48). For a graph that will be differentiated this restores what eager autograd passes. CPU's SDPA
    kernels have no such flag: there the graph does not change."""
    changed = 0
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        names = [a.name for a in schema.arguments] if schema is not None else []
        if "compute_log_sumexp" not in names:
            continue
        i = names.index("compute_log_sumexp")
        if i < len(node.args):
            if node.args[i] is True:
                continue
            node.args = (*node.args[:i], True, *node.args[i + 1 :])
        elif node.kwargs.get("compute_log_sumexp") is not True:
            node.kwargs = {**node.kwargs, "compute_log_sumexp": True}
        else:
            continue
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
        with fake_mode:
            node.meta["val"] = out = node.target(*args, **kwargs)
        for user in node.users:  # operator.getitem(node, k): the logsumexp is output 1
            if user.target is operator.getitem and isinstance(user.args[1], int):
                user.meta["val"] = out[user.args[1]]
        changed += 1
    return changed


def _runs_functorch_transforms(gm: fx.GraphModule | None) -> bool:
    """Whether Dynamo's graph `gm` runs a functorch transform itself: ``torch.vmap`` inlined as the batch-dim ops of
    ``torch._functorch.predispatch`` (HF Mamba's and Jamba's layers). torch.func.functionalize, a functorch
    transform too, cannot wrap those levels ("layer.key() == TransformType::Functionalize INTERNAL ASSERT FAILED")
    and the model ran eagerly; the dispatch-level functionalization below, AOTAutograd's own, traces them."""
    if gm is None:
        return False
    return any(
        n.op == "call_function" and getattr(n.target, "__module__", None) == "torch._functorch.predispatch"
        for n in gm.graph.nodes
    )


def _dispatch_functionalize(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` functionalized the way AOTAutograd does it (torch's FunctionalTensorMode), for symbolic sizes and for
    graphs that run functorch transforms (_runs_functorch_transforms).

    torch.func.functionalize (the static path above) wraps tensors at the functorch layer, whose wrappers
    cannot give a symbolic element count: aten's C++ dropout (alone, or inside SDPA's math path) asks for one and
    the trace fails ("Cannot call numel() on tensor with symbolic sizes/strides"). FunctionalTensorMode runs
    below __torch_dispatch__ and, with the Python dispatcher on, dropout takes its Python decomposition
    (native_dropout), which fuse_bias_dropout_add and fuse_attention match. Input mutations become copy_ into
    the input at the end, as torch.func.functionalize(remove="mutations") writes them; views are kept."""
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

    def functional(*args: Any) -> Any:
        no_functorch = torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize))
        with no_functorch, FunctionalTensorMode():
            wrapped = [FunctionalTensor.to_functional(a) if isinstance(a, torch.Tensor) else a for a in args]
            out = fn(*wrapped)
            for w in wrapped:
                if isinstance(w, FunctionalTensor):
                    torch._sync(w)
                    if torch._functionalize_has_metadata_mutation(w.elem):
                        raise RuntimeError(
                            "the graph changes an input's shape or strides in place (e.g. "
                            "`x.t_()` on an input); graphtrain cannot trace that under dynamic "
                            "shapes: use engine.dynamic=false"
                        )

            def unwrap(t: Any) -> Any:
                return torch._from_functional_tensor(t.elem) if isinstance(t, FunctionalTensor) else t

            mutated = [
                (a, unwrap(w))
                for a, w in zip(args, wrapped)
                if isinstance(w, FunctionalTensor) and torch._functionalize_has_data_mutation(w.elem)  # type: ignore[attr-defined]
            ]
            out = torch.utils._pytree.tree_map_only(FunctionalTensor, lambda t: (torch._sync(t), unwrap(t))[1], out)
        for original, new in mutated:  # outside the mode: traced as the graph's write into its input
            original.copy_(new)
        return out

    return functional


def fakify_like_dynamo(fake_mode: FakeTensorMode, example_inputs: Sequence[Any]) -> list[Any]:
    """Fake versions of a Dynamo graph's real example inputs, in the backend's fake mode: tensors keep the
    symbolic sizes Dynamo chose (its per-tensor symbolic context), ints become SymInts under dynamic shapes."""
    ctx = torch._guards.TracingContext.try_get()
    shape_env = fake_mode.shape_env
    out: list[Any] = []
    for i, x in enumerate(example_inputs):
        if isinstance(x, FakeTensor):
            out.append(x if x.fake_mode is fake_mode else fake_mode.from_tensor(x))
        elif isinstance(x, torch.Tensor):
            sc = ctx.tensor_to_context.get(x) if ctx is not None else None
            # A tensor Dynamo did not see (a DTensor parameter's local shard, pipeline/trace.localize) is static.
            out.append(
                fake_mode.from_tensor(
                    x,
                    symbolic_context=sc,
                    source=sc.tensor_source if sc else None,
                    static_shapes=shape_env is None or sc is None,
                )
            )
        elif isinstance(x, int) and not isinstance(x, bool) and shape_env is not None:
            from torch._dynamo.source import ConstantSource

            src = ConstantSource(f"graphtrain_sym_{i}")
            out.append(
                shape_env.create_symintnode(shape_env.create_symbol(x, src, positive=x >= 0), hint=x, source=src)
            )
        else:
            out.append(x)
    return out


def dtensor_inputs(example_inputs: Sequence[Any]) -> list[int]:
    """Positions of DTensor inputs (tensor-parallel parameters) among a Dynamo graph's inputs."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return []
    return [i for i, x in enumerate(example_inputs) if isinstance(x, DTensor)]


def localize(
    gm: fx.GraphModule, example_inputs: Sequence[Any], positions: Sequence[int]
) -> tuple[fx.GraphModule, list[Any]]:
    """The Dynamo graph on local shards: each DTensor input at `positions` becomes a plain input (its local
    tensor) and the graph's `.to_local()` calls on it are dropped; returns (graph, example inputs).

    graphtrain's tensor parallelism (distributed/tensor_parallel.py) reads its DTensor parameters only
    through `.to_local()` and runs every activation and collective on plain tensors, so the result is an
    ordinary single-rank graph the pre-autodiff passes work on. Any other use of a DTensor (DTensor
    arithmetic, `redistribute`, torch's ColwiseParallel hooks) raises ValueError."""
    gm = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    inputs = list(example_inputs)
    for i in positions:
        ph = placeholders[i]
        for user in list(ph.users):
            if not _plain_to_local(user):
                raise ValueError(
                    f"DTensor input {ph.target} is used by `{user.format_node()}`: graphtrain's passes run on "
                    f"plain local tensors, which needs DTensor parameters read through .to_local() only "
                    f"(graphtrain.distributed.tensor_parallel's layers; torch's ColwiseParallel/RowwiseParallel "
                    f"keep activations as DTensors)"
                )
            user.replace_all_uses_with(ph)
            gm.graph.erase_node(user)
        inputs[i] = example_inputs[i].to_local()
    gm.recompile()
    return gm, inputs


def _plain_to_local(node: fx.Node) -> bool:
    """Whether `node` is `x.to_local()` with no arguments: a ``to_local`` method call (torch 2.13, 2.14), or the
    function torch 2.11's Dynamo records in its place, ``prim_to_local``, closing over the call's (empty) arguments."""
    if node.op == "call_method":
        return node.target == "to_local" and len(node.args) == 1 and not node.kwargs
    if node.op != "call_function" or getattr(node.target, "__name__", "") != "prim_to_local":
        return False
    bound = [c.cell_contents for c in getattr(node.target, "__closure__", None) or ()]
    return len(node.args) == 1 and not node.kwargs and not any(v for v in bound if isinstance(v, (list, dict)))


def delocalize(local: fx.GraphModule, positions: Sequence[int]) -> fx.GraphModule:
    """`local` (a graph from `localize`, after passes) taking the DTensor inputs again: `.to_local()` on each
    input at `positions`, then `local`'s nodes. AOTAutograd unwraps DTensor inputs itself and
    differentiates `.to_local()` (the gradient comes back as a DTensor with the parameter's placements)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, node in enumerate(n for n in local.graph.nodes if n.op == "placeholder"):
        ph = graph.placeholder(node.name)
        if i in positions:
            env[node] = graph.call_method("to_local", (ph,))
            env[node].meta = dict(node.meta)
        else:
            ph.meta = dict(node.meta)
            env[node] = ph
    graph.output(graph.graph_copy(local.graph, env))
    return fx.GraphModule(local, graph)


def switches_grad_mode(fn: Callable[..., Any], example_inputs: Sequence[torch.Tensor]) -> bool:
    """Whether `fn(*example_inputs)`, run on fake tensors with grad enabled, runs any op with grad disabled (a
    ``with torch.no_grad():`` block inside). ``trace_aten_forward`` traces under no_grad and cannot see such a block:
    a caller that differentiates the traced graph asks this first. Reads the grad mode at each op below autograd,
    where a no_grad block has switched it off and the code around it has not."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Probe(TorchDispatchMode):
        seen = False

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            Probe.seen = Probe.seen or not torch.is_grad_enabled()
            return func(*args, **(kwargs or {}))

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    inputs = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    with fake_mode, torch.enable_grad(), compiling_flag(), Probe():
        fn(*inputs)
    return Probe.seen


def _logging_ignored() -> contextlib.AbstractContextManager[Any]:
    """Dynamo told to skip `logging.Logger` calls, as torch.export does: a library's log line (Hugging Face's
    ``warning_once`` about the loss type, in GPT-2) is otherwise a graph break, and a capture that must be whole
    fails on it. The capture never runs the model, so nothing would have been logged from it anyway."""
    import logging

    config = torch._dynamo.config
    name = next((n for n in ("ignore_logging_functions", "ignore_logger_methods") if hasattr(config, n)), None)
    if name is None:  # a torch without the setting: a log call breaks the graph, the caller's fallback runs
        return contextlib.nullcontext()
    methods = ("debug", "info", "warning", "warn", "error", "critical", "exception", "log", "warning_once", "info_once")
    ignored = {getattr(logging.Logger, m) for m in methods if hasattr(logging.Logger, m)}
    return config.patch({name: set(getattr(config, name)) | ignored})


class _Captured(Exception):
    """Raised instead of running the graph `capture_whole` captured: the capture must not run the model."""


def capture_whole(fn: Callable[..., Any], example_inputs: Sequence[torch.Tensor]) -> fx.GraphModule:
    """`fn(*example_inputs)` captured by Dynamo as one graph, without running it; its placeholders are
    `example_inputs` in order (one for each, used or not).

    Captured with grad enabled, as a training step runs the forward: Dynamo then records a user's
    ``autograd.Function`` as one ``autograd_function_apply`` node (its forward and backward bodies) and a
    ``with torch.no_grad():`` block as grad-mode nodes, which the dynamo-stage passes handle
    (passes/autograd_functions.py, passes/no_grad_regions.py). graphtrain's trace of a plain function
    (``trace_aten_forward``) sees neither: it runs under no_grad and functorch's functionalize, which refuses an
    old-style autograd.Function and cannot tell a no_grad block from the code around it.

    Raises where Dynamo cannot capture the whole function (a graph break: ``fullgraph``), or where the graph's
    inputs are not `example_inputs` (a constant tensor Dynamo lifted). The Dynamo cache entry is removed: a
    capture leaves nothing behind that a later one would count against Dynamo's recompile limit."""
    graphs: list[tuple[fx.GraphModule, list[Any]]] = []

    def grab(gm: fx.GraphModule, inputs: list[Any]) -> Callable[..., Any]:
        graphs.append((gm, list(inputs)))

        def not_run(*_: Any) -> Any:
            raise _Captured

        return not_run

    def entry(*args: Any) -> Any:
        return fn(*args)

    compiled = torch.compile(entry, backend=grab, fullgraph=True, dynamic=False)
    try:
        with torch.enable_grad(), _logging_ignored():
            compiled(*example_inputs)
    except _Captured:
        pass
    finally:
        torch._dynamo.eval_frame.remove_from_cache(entry)
    if len(graphs) != 1:
        raise RuntimeError(f"Dynamo captured {len(graphs)} graphs of the forward, not one")
    gm, inputs = graphs[0]
    position = {id(x): i for i, x in enumerate(example_inputs)}
    old = [n for n in gm.graph.nodes if n.op == "placeholder"]
    missing = [n.name for n, x in zip(old, inputs) if id(x) not in position]
    if len(old) != len(inputs) or missing:
        raise RuntimeError(f"the Dynamo graph of the forward takes inputs that are not the model's: {missing[:3]}")
    graph = fx.Graph()
    new = [graph.placeholder(f"arg{i}") for i in range(len(example_inputs))]
    val_map: dict[fx.Node, fx.Node] = {}
    for node, x in zip(old, inputs):
        val_map[node] = new[position[id(x)]]
        val_map[node].meta = dict(node.meta)
    out = graph.graph_copy(gm.graph, val_map)
    graph.output(out)
    return fx.GraphModule(gm, graph)
