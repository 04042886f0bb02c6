"""Trace a forward function to graphtrain's pre-autodiff IR.

The IR: a functional aten-level FX graph (no in-place ops; views kept), traced with fake tensors,
parameters and buffers as ordinary placeholders, every node carrying ``meta["val"]`` (a fake
tensor with shape and dtype). Pre-autodiff passes and fusion patterns are written against it, and
AOTAutograd builds the gradient graph from it.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx


def trace_aten_forward(fn: Callable[..., Any], example_inputs: Sequence[Any]) -> fx.GraphModule:
    """Trace `fn(*example_inputs)` (no autograd recorded) into the functional aten forward IR."""
    fake_mode = detect_fake_mode(example_inputs)
    functional = torch.func.functionalize(fn, remove="mutations")
    if fake_mode is None:
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        inputs = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    else:
        inputs = list(example_inputs)
    with fake_mode, torch.no_grad():
        gm = make_fx(functional, tracing_mode="real", pre_dispatch=False)(*inputs)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def module_as_function(module: torch.nn.Module) -> tuple[Callable[..., Any], list[torch.Tensor], list[str]]:
    """Turn `module` into f(*params_and_buffers, *inputs) for tracing; returns (f, tensors, kinds).

    kinds[i] is "param" (trainable), "frozen" (parameter without requires_grad) or "buffer"."""
    named = dict(module.named_parameters(remove_duplicate=False))
    named_params = list(dict(module.named_parameters()).items())
    named_buffers = list(dict(module.named_buffers()).items())
    names = [n for n, _ in named_params] + [n for n, _ in named_buffers]
    tensors = [t for _, t in named_params] + [t for _, t in named_buffers]
    kinds = ["param" if t.requires_grad else "frozen" for _, t in named_params] + ["buffer"] * len(named_buffers)
    del named

    def f(*args: Any) -> Any:
        state = dict(zip(names, args[: len(names)]))
        return torch.func.functional_call(module, state, tuple(args[len(names):]), tie_weights=True)

    return f, tensors, kinds
