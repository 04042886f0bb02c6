"""A module as a function of its state, and the loss a model returned: how graphtrain calls a model it compiles.

    f, tensors, kinds = module_as_function(model, loss=True)
    loss = f(*tensors, *batch)          # == model(*batch), on whatever tensors are passed for the state

One helper for every compile path (frontend/capture.py's training-step capture, frontend/compile_step.py's whole
step, the tests' pre-autodiff traces) and one loss rule (those, tools/bisect.py and distributed/).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.fx import traceback as fx_traceback

LAYER_KEY = "graphtrain_layer"
"""``node.meta["custom"][LAYER_KEY]``: the nn.ModuleList child a traced op belongs to (memory/recompute.py's
layer_regions reads it for recompute=full, as it reads Dynamo's nn_module_stack in the engine's graphs)."""


def module_as_function(
    module: torch.nn.Module, *, input_names: Sequence[str] | None = None, loss: bool = False, annotate: bool = True
) -> tuple[Callable[..., Any], list[torch.Tensor], list[str]]:
    """`module` as f(*params, *buffers, *inputs); returns (f, the parameter and buffer tensors in order, kinds).

    kinds[i] is "param" (trainable), "frozen" (parameter without requires_grad) or "buffer". Tied weights count
    once. `input_names`: pass the inputs as these keyword arguments (else positionally). `loss`: f returns the
    model's loss (`loss_of`) instead of its output. While f runs, each op a layer performs is annotated with
    the layer's name (`annotate_layers`; visible when traced under ``fx.traceback.preserve_node_meta``), unless
    `annotate` is false (Dynamo cannot trace the hooks that annotate; its graph has the layers in nn_module_stack)."""
    named_params = list(dict(module.named_parameters()).items())
    named_buffers = list(dict(module.named_buffers()).items())
    names = [n for n, _ in named_params] + [n for n, _ in named_buffers]
    tensors = [t for _, t in named_params] + [t for _, t in named_buffers]
    kinds = ["param" if t.requires_grad else "frozen" for _, t in named_params] + ["buffer"] * len(named_buffers)
    n = len(names)
    keys = list(input_names) if input_names is not None else None

    def f(*args: Any) -> Any:
        state = dict(zip(names, args[:n]))
        inputs = args[n:]
        with annotate_layers(module) if annotate else contextlib.nullcontext():
            if keys is None:
                out = torch.func.functional_call(module, state, tuple(inputs), tie_weights=True)
            else:
                out = torch.func.functional_call(module, state, (), dict(zip(keys, inputs)), tie_weights=True)
        return loss_of(out) if loss else out

    return f, tensors, kinds


def loss_of(out: Any) -> torch.Tensor:
    """The loss a model's forward returned: a tensor (graphtrain's models), or an output with a `.loss` tensor
    (Hugging Face models given labels=); TypeError otherwise."""
    if isinstance(out, torch.Tensor):
        return out
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    raise TypeError(
        f"the model's forward must return the loss (a tensor, or an object with a .loss tensor such "
        f"as a Hugging Face output given labels=); got {type(out).__name__}"
    )


@contextlib.contextmanager
def annotate_layers(model: torch.nn.Module) -> Iterator[None]:
    """Annotate what each child of an nn.ModuleList computes with its qualified name (forward hooks that
    enter/exit ``torch.fx.traceback.annotate``), and everything else with None; outer lists win over
    nested ones."""
    handles = []
    claimed: set[str] = set()
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.ModuleList) or len(mod) < 2 or any(name.startswith(c + ".") for c in claimed):
            continue
        claimed.add(name)
        for i, layer in enumerate(mod):
            key = f"{name}.{i}" if name else str(i)
            frames: list[contextlib.ExitStack] = []

            def pre(_m: Any, _a: Any, key: str = key, frames: list = frames) -> None:
                es = contextlib.ExitStack()
                es.enter_context(fx_traceback.annotate({LAYER_KEY: key}))
                frames.append(es)

            def post(_m: Any, _a: Any, _o: Any, frames: list = frames) -> None:
                frames.pop().close()

            handles += [layer.register_forward_pre_hook(pre), layer.register_forward_hook(post)]
    try:
        with fx_traceback.annotate({LAYER_KEY: None}):  # outside every layer
            yield
    finally:
        for h in handles:
            h.remove()
