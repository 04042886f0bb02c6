"""Mixed precision as a graph rewrite: matmuls and the bulk of elementwise work in bf16/fp16.

``apply_mixed_precision_pass`` rewrites the pre-autodiff forward graph once, so AOTAutograd then
derives a backward graph that is mixed precision too, with fp32 gradients for the fp32 parameters
(master weights): the gradient of a cast is a cast back.

The policy of graphtrain's fused ops is their descriptor's ``precision`` (kernels/<op>.py); for every
other op it is a table, ``PRECISION_POLICY``, keyed by op schema name (``"aten::mm"``):

- ``LOW``: compute in the low dtype; fp32 inputs are cast down (matmul family, conv, attention).
- ``FP32``: compute in fp32; low inputs are cast up (softmax, normalization, reductions, losses).
- ``FOLLOW`` (any op not in the table): type promotion as in eager autocast: low only when every
  floating input is already low (``gelu`` of a matmul output), else fp32 (the residual stream,
  which starts from fp32 embeddings, stays fp32).

Casts are created on demand and memoized per (value, dtype); a cast wanted after a shape-only op
(``t``, ``view``, ``expand``, ...) is hoisted above it, so each parameter is cast once however
many times and through whatever views it is used. Cast-of-cast chains collapse and a cast back to
a value's own earlier dtype reuses that value. Graph outputs are cast back to their original dtype,
so the output signature never changes. Only fp32 values change; fp64 graphs are left alone.

Numerics change (``changes_numerics=True``); the pass does nothing when ``precision == "fp32"``.
Ops of other libraries get a policy with ``set_precision_policy(name, policy)``.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from graphtrain.kernels.registry import FOLLOW, FP32, LOW, op_descriptor
from graphtrain.passes.graph_utils import arg_node, is_cast
from graphtrain.passes.manager import PassContext, register_pass

PRECISION_POLICY: dict[str, str] = {
    # matmul family, convolution, attention: the work the low dtype speeds up
    **{
        f"aten::{n}": LOW
        for n in (
            "mm",
            "addmm",
            "bmm",
            "baddbmm",
            "addbmm",
            "matmul",
            "linear",
            "dot",
            "vdot",
            "mv",
            "addmv",
            "convolution",
            "_convolution",
            "conv1d",
            "conv2d",
            "conv3d",
            "conv_transpose1d",
            "conv_transpose2d",
            "scaled_dot_product_attention",
            "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention",
            "_scaled_dot_product_attention_math",
            "_native_multi_head_attention",
        )
    },
    # softmax, normalization statistics, reductions, losses: numerically sensitive, stay fp32
    **{
        f"aten::{n}": FP32
        for n in (
            "_softmax",
            "softmax",
            "_log_softmax",
            "log_softmax",
            "logsumexp",
            "native_layer_norm",
            "layer_norm",
            "native_group_norm",
            "group_norm",
            "native_batch_norm",
            "_native_batch_norm_legit",
            "_native_batch_norm_legit_functional",
            "_native_batch_norm_legit_no_training",
            "batch_norm",
            "instance_norm",
            "rms_norm",
            "_fused_rms_norm",
            "sum",
            "mean",
            "var",
            "var_mean",
            "std",
            "std_mean",
            "prod",
            "cumsum",
            "cumprod",
            "norm",
            "linalg_vector_norm",
            "frobenius_norm",
            "nansum",
            "nll_loss_forward",
            "nll_loss2d_forward",
            "nll_loss",
            "nll_loss_nd",
            "cross_entropy_loss",
            "mse_loss",
            "l1_loss",
            "smooth_l1_loss",
            "huber_loss",
            "binary_cross_entropy",
            "binary_cross_entropy_with_logits",
            "kl_div",
            "soft_margin_loss",
            "multilabel_margin_loss_forward",
            "cosine_embedding_loss",
            "exp",
            "log",
            "pow",
            "rsqrt",
            "erfinv",
            # complex numbers and FFTs: no bf16 complex dtype exists, and the CPU FFTs take no bf16 either. A model
            # that writes `torch.view_as_complex(xq.float()...)` (Meta's Llama rotary, torchtitan's) was traced in
            # fp32, where `.float()` leaves no cast in the graph, so its input must be made fp32 here.
            "view_as_complex",
            "complex",
            "polar",
            "_fft_r2c",
            "_fft_c2r",
            "_fft_c2c",
        )
    },
}

# Shape-only ops a cast may be hoisted above (same elements, or fewer before an expand).
_HOISTABLE = {
    f"aten::{n}"
    for n in (
        "t",
        "view",
        "_unsafe_view",
        "reshape",
        "transpose",
        "permute",
        "expand",
        "unsqueeze",
        "squeeze",
        "alias",
        "detach",
        "_reshape_alias",
    )
}
_LOW_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# Ops whose scalar argument becomes an element of their result, through a checked conversion to the result's dtype.
# A model that masks with `torch.finfo(x.dtype).min` was traced in fp32, so the graph holds fp32's -3.4e38; once the
# op runs in bf16 or fp16 that value no longer fits and the kernel raises ("value cannot be converted to type
# c10::BFloat16 without overflow": HF DeBERTa-v2's attention mask). `_fit_fill_values` puts such a value at the low
# dtype's own extreme, the value the model computes under autocast, where x is already low.
_FILLS = {f"aten::{n}" for n in ("masked_fill", "fill", "index_fill", "scatter", "where", "constant_pad_nd")}


def set_precision_policy(op: str | torch._ops.OpOverload | torch._ops.OpOverloadPacket, policy: str) -> None:
    """Declare how the mixed-precision pass treats an op: LOW, FP32 or FOLLOW (by op or schema name)."""
    if policy not in (LOW, FP32, FOLLOW):
        raise ValueError(f"precision policy must be {LOW!r}, {FP32!r} or {FOLLOW!r}, got {policy!r}")
    key = _op_key(op)
    if key.startswith("graphtrain::"):
        raise ValueError(
            f"{key}'s precision policy is its descriptor's `precision`, beside its kernel "
            f"(graphtrain/kernels/); set it there"
        )
    PRECISION_POLICY[key] = policy


def _op_key(op: Any) -> str:
    if isinstance(op, str):
        if "::" not in op:
            raise ValueError(f"name the op with its namespace, e.g. 'aten::{op}' or 'graphtrain::{op}'")
        return op
    if isinstance(op, torch._ops.OpOverload):
        return op._schema.name
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op._qualified_op_name
    raise TypeError(f"expected an op or a 'namespace::name' string, got {type(op).__name__}")


def policy_of(node: fx.Node) -> str:
    """LOW, FP32 or FOLLOW: a graphtrain op's descriptor, else the table (FOLLOW for ops not in it)."""
    if isinstance(node.target, torch._ops.OpOverload):
        d = op_descriptor(node.target)
        return d.precision if d is not None else PRECISION_POLICY.get(node.target._schema.name, FOLLOW)
    return FOLLOW


def count_casts(gm: fx.GraphModule) -> int:
    return sum(is_cast(n) for n in gm.graph.nodes)


def _dtype(node: Any) -> torch.dtype | None:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v.dtype if isinstance(v, torch.Tensor) else None


@register_pass("pre_autodiff", phase="precision", changes_numerics=True)
def apply_mixed_precision_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Run matmuls and most elementwise ops in ``ctx.config.precision``; see the module docstring."""
    if ctx.config.precision == "fp32":
        return gm
    low = _LOW_DTYPES[ctx.config.precision]
    casts_before = count_casts(gm)
    rw = _Rewriter(gm.graph, low)
    for node in list(gm.graph.nodes):
        rw.visit(node)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    _refresh_meta(gm)
    param_casts = 0
    if ctx.input_kinds is not None:
        phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        params = {p for p, k in zip(phs, ctx.input_kinds) if k in ("param", "frozen")}
        param_casts = sum(is_cast(n) and n.args[0] in params for n in gm.graph.nodes)
    gm.meta["graphtrain_casts"] = {
        "before": casts_before,
        "after": count_casts(gm),
        "low_ops": rw.low_ops,
        "removed": rw.removed,
        "parameter_casts": param_casts,
    }
    ctx.count(rw.low_ops + rw.removed)
    return gm


class _Rewriter:
    """One walk over the graph in order, tracking each value's current dtype."""

    def __init__(self, graph: fx.Graph, low: torch.dtype) -> None:
        self.graph, self.low = graph, low
        self.fake_mode = detect_fake_mode([n.meta.get("val") for n in graph.nodes if n.op == "placeholder"])
        out = next(n for n in reversed(graph.nodes) if n.op == "output")
        self.out_dtypes = [_dtype(a) for a in torch.utils._pytree.tree_leaves(out.args[0])]
        self.dtype: dict[fx.Node, torch.dtype | None] = {}
        self.compute: dict[fx.Node, torch.dtype] = {}  # multi-output nodes: the dtype they computed in
        self.casts: dict[tuple[fx.Node, torch.dtype], fx.Node] = {}
        self.low_ops = 0
        self.removed = 0

    def visit(self, node: fx.Node) -> None:
        orig = _dtype(node)
        if node.op in ("placeholder", "get_attr"):
            self.dtype[node] = orig
        elif node.op == "output":
            self._fix_outputs(node)
        elif node.op != "call_function":
            self.dtype[node] = orig
        elif node.target is operator.getitem:
            parent = node.args[0]
            self.dtype[node] = (
                self.compute[parent]
                if (orig == torch.float32 and isinstance(parent, fx.Node) and parent in self.compute)
                else orig
            )
        elif is_cast(node):
            self._visit_cast(node, orig)
        else:
            self._visit_op(node, orig)

    def _visit_cast(self, node: fx.Node, orig: torch.dtype | None) -> None:
        src = node.args[0]
        if not isinstance(src, fx.Node):  # a cast of a constant: no value of the graph to track
            self.dtype[node] = orig
            return
        if self.dtype.get(src) == orig:  # now a no-op (e.g. an explicit .float() of a value that stays fp32)
            node.replace_all_uses_with(src)
            self.removed += 1
            return
        if is_cast(src) and orig is not None and orig.is_floating_point and (inner := arg_node(src, 0)) is not None:
            new = self._cast(inner, orig, node)  # cast of a cast: cast the original value instead
            node.replace_all_uses_with(new)
            self.removed += 1
            return
        self.dtype[node] = orig

    def _visit_op(self, node: fx.Node, orig: torch.dtype | None) -> None:
        policy = policy_of(node)
        inputs = [a for a in node.all_input_nodes if self.dtype.get(a) in (torch.float32, self.low)]
        val = node.meta.get("val")
        out_dtypes = {v.dtype for v in torch.utils._pytree.tree_leaves(val) if isinstance(v, torch.Tensor)}
        if (
            not inputs
            or node.kwargs.get("dtype") is not None
            or torch.float64 in out_dtypes
            or any(self.dtype.get(a) == torch.float64 for a in node.all_input_nodes)
        ):
            self.dtype[node] = orig  # creates its own dtype, or fp64 work: leave it
            return
        if policy == LOW:
            target = self.low
        elif policy == FP32:
            target = torch.float32
        else:  # type promotion; 0-dim tensors (lifted scalars) don't take part, as in eager
            deciding = [a for a in inputs if a.meta["val"].dim() > 0] or inputs
            target = self.low if all(self.dtype[a] == self.low for a in deciding) else torch.float32
        with self.graph.inserting_before(node):
            for a in inputs:
                if self.dtype[a] != target:
                    node.replace_input_with(a, self._cast(a, target, node))
        if target == self.low and torch.float32 in out_dtypes:
            self.low_ops += 1
            if isinstance(node.target, torch._ops.OpOverload) and node.target._schema.name in _FILLS:
                _fit_fill_values(node, self.low)
        self.compute[node] = target
        self.dtype[node] = target if orig == torch.float32 else orig

    def _cast(self, src: fx.Node, dtype: torch.dtype, before: fx.Node) -> fx.Node:
        """`src` as `dtype`: memoized, hoisted above shape-only ops, collapsing cast chains."""
        if self.dtype.get(src) == dtype:
            return src
        key = (src, dtype)
        if key in self.casts:
            return self.casts[key]
        first = arg_node(src, 0)  # what a cast or a shape-only op of `src` reads
        first_dtype = self.dtype.get(first) if first is not None else None
        if is_cast(src) and first is not None and first_dtype is not None and first_dtype.is_floating_point:
            new = self._cast(first, dtype, before)  # back and forth, or cast of a cast
        elif (
            isinstance(src.target, torch._ops.OpOverload)
            and src.target._schema.name in _HOISTABLE
            and first is not None
            and self.dtype.get(first) == self.dtype.get(src)
        ):
            inner = self._cast(first, dtype, before)
            with self.graph.inserting_before(before):
                new = self.graph.call_function(src.target, (inner, *src.args[1:]), dict(src.kwargs))
            new.meta["val"] = self._fake(src.target, inner.meta["val"], *src.args[1:], **src.kwargs)
        else:
            with self.graph.inserting_before(before):
                new = self.graph.call_function(torch.ops.aten._to_copy.default, (src,), {"dtype": dtype})
            new.meta["val"] = self._fake(torch.ops.aten._to_copy.default, src.meta["val"], dtype=dtype)
        self.casts[key] = new
        self.dtype[new] = dtype
        return new

    def _fake(self, op: Any, *args: Any, **kwargs: Any) -> Any:
        """`op` on fake tensors: the new node's meta["val"] (real constants are faked first)."""
        fake_mode = self.fake_mode
        if fake_mode is None:
            raise AssertionError("mixed precision needs fake-tensor meta['val'] on placeholders (trace_aten_forward)")

        def fake(v: Any) -> Any:
            if isinstance(v, torch.Tensor) and not isinstance(v, torch._subclasses.fake_tensor.FakeTensor):
                return fake_mode.from_tensor(v, static_shapes=True)
            return v

        with fake_mode:
            return op(*map(fake, args), **kwargs)

    def _fix_outputs(self, node: fx.Node) -> None:
        """Cast every output back to its original dtype: the signature must not change."""
        leaves, spec = torch.utils._pytree.tree_flatten(node.args[0])
        for i, (a, want) in enumerate(zip(leaves, self.out_dtypes)):
            if isinstance(a, fx.Node) and want is not None and self.dtype.get(a) != want:
                leaves[i] = self._cast(a, want, node)
        node.args = (torch.utils._pytree.tree_unflatten(leaves, spec),)


def _fit_fill_values(node: fx.Node, low: torch.dtype) -> None:
    """A finite float argument of a fill op (`_FILLS`) beyond `low`'s range, set to `low`'s extreme of its sign."""
    big = torch.finfo(low).max

    def fit(a: Any) -> Any:
        return math.copysign(big, a) if isinstance(a, float) and math.isfinite(a) and abs(a) > big else a

    node.args = tuple(fit(a) for a in node.args)
    node.kwargs = {k: fit(v) for k, v in node.kwargs.items()}


def _refresh_meta(gm: fx.GraphModule) -> None:
    """Re-run fake-tensor propagation so every node's meta["val"] has its new dtype."""
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    vals = [n.meta.get("val") for n in phs]
    mode = detect_fake_mode(vals)
    if mode is None or any(
        not isinstance(v, torch.Tensor) and v is not None and not isinstance(v, (int, float, bool)) for v in vals
    ):
        raise AssertionError("mixed precision needs fake-tensor meta['val'] on every placeholder (trace_aten_forward)")
    with mode:
        _FakeProp(gm, mode).propagate_dont_convert_inputs(*vals)


class _FakeProp(FakeTensorProp):
    """FakeTensorProp that also accepts real tensor attributes (constants folded by earlier passes)."""

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        v = super().get_attr(target, args, kwargs)
        if isinstance(v, torch.Tensor) and not isinstance(v, torch._subclasses.fake_tensor.FakeTensor):
            v = self._mode.from_tensor(v, static_shapes=True)
        return v
