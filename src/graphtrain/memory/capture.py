"""Capture a model's training graphs with AOTAutograd, and run them with graphtrain's memory rules.

Two users: ``predict_for_model`` / ``pick_batch_size`` capture on fake tensors (no activation is
allocated, so a batch of any size can be predicted), and tests/benchmarks run the captured step
for real (``compile_train_step``) the way the engine's aten provider will: partitioned by
``make_partition_fn``, forward/backward passes applied, and each graph compiled to the *boxed*
calling convention (``to_boxed``), so the backward frees every saved activation right after its
last use instead of holding all of them until it returns.

Calling convention (AOTAutograd): forward inputs are (*parameters, *buffers, *batch); forward
outputs are (loss, *saved for backward); backward inputs are (*saved, tangent) and its outputs are
one gradient per forward input (None for the batch).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx as fx
from torch._functorch.aot_autograd import aot_function
from torch._subclasses.fake_tensor import FakeTensorMode

from graphtrain.memory.predict import param_bytes
from graphtrain.memory.recompute import RecomputeRecord, make_partition_fn

GraphPass = Callable[[fx.GraphModule, Any], fx.GraphModule]


@dataclass
class Captured:
    fw_gm: fx.GraphModule
    bw_gm: fx.GraphModule
    param_bytes: int
    n_state_inputs: int  # leading forward inputs that are parameters or buffers
    num_fwd_outputs: int
    records: list[RecomputeRecord] = field(default_factory=list)


def functional_model(model: torch.nn.Module) -> tuple[Callable[..., Any], list[torch.Tensor]]:
    """f(*params, *buffers, *batch) -> scalar loss, and the parameter/buffer tensors in order.

    While f runs, every op a layer of `model` (a child of an nn.ModuleList) performs is annotated with
    the layer's name (``node.meta["custom"]["graphtrain_layer"]`` when traced under
    ``fx.traceback.preserve_node_meta``): what Dynamo's nn_module_stack tells the engine's graphs,
    for recompute=full to find checkpoint regions."""
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    names = list(params) + list(buffers)
    state = list(params.values()) + list(buffers.values())

    def f(*args: Any) -> torch.Tensor:
        with annotate_layers(model):
            out = torch.func.functional_call(model, dict(zip(names, args[: len(names)])), tuple(args[len(names):]))
        return out if isinstance(out, torch.Tensor) else out.loss
    return f, state


@contextlib.contextmanager
def annotate_layers(model: torch.nn.Module) -> Iterator[None]:
    """Annotate what each child of an nn.ModuleList computes with its qualified name (forward hooks that
    enter/exit ``torch.fx.traceback.annotate``), and everything else with None; outer lists win over
    nested ones."""
    from torch.fx import traceback as fx_traceback
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
                es.enter_context(fx_traceback.annotate({"graphtrain_layer": key}))
                frames.append(es)

            def post(_m: Any, _a: Any, _o: Any, frames: list = frames) -> None:
                frames.pop().close()
            handles += [layer.register_forward_pre_hook(pre), layer.register_forward_hook(post)]
    try:
        with fx_traceback.annotate({"graphtrain_layer": None}):  # outside every layer
            yield
    finally:
        for h in handles:
            h.remove()


def to_boxed(gm: fx.GraphModule) -> fx.GraphModule:
    """Compile `gm` to the boxed calling convention: it takes the argument list and clears it, so
    an input is released after its last use (FX code already drops each intermediate after its
    last use with ``x = None``). Without this the backward keeps every saved activation alive
    until it returns."""
    gm.graph.set_codegen(fx.graph._BoxedCodeGen())
    gm.recompile()
    assert gm._boxed_call  # a property of the codegen: AOTAutograd then hands over the argument list
    return gm


def _pass_ctx(engine_cfg: Any, stage: str, name: str) -> Any:
    from graphtrain.config import EngineConfig
    from graphtrain.passes.manager import PassContext
    return PassContext(config=engine_cfg or EngineConfig(), stage=stage, graph_name=name)


def _compiler(stage: str, passes: Sequence[GraphPass], boxed: bool, engine_cfg: Any, sink: list | None,
              rewrites: dict[str, int] | None) -> Callable[..., Any]:
    def compile_fn(gm: fx.GraphModule, example_inputs: Any) -> Any:
        for p in passes:
            ctx = _pass_ctx(engine_cfg, stage, f"{stage} graph")
            gm = p(gm, ctx)
            gm.recompile()
            if rewrites is not None:
                rewrites[f"{stage}/{p.__name__}"] = rewrites.get(f"{stage}/{p.__name__}", 0) + ctx.rewrites
        if sink is not None:
            sink.append(gm)
        if boxed:
            return to_boxed(gm)
        from functorch.compile import make_boxed_func
        return make_boxed_func(gm.forward)
    return compile_fn


def capture_graphs(model: torch.nn.Module, example_batch: Sequence[Any], engine_cfg: Any = None, *,
                   optimizer: str = "adamw", fw_passes: Sequence[GraphPass] = (),
                   bw_passes: Sequence[GraphPass] = ()) -> Captured:
    """Trace forward+loss+backward of `model(*example_batch)` on fake tensors and partition it
    with engine_cfg's recompute mode. Nothing is executed for real."""
    f, state = functional_model(model)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    fake_state = [fake_mode.from_tensor(t) for t in state]
    fake_batch = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_batch]
    pbytes = param_bytes(state)
    records: list[RecomputeRecord] = []
    graphs: dict[str, fx.GraphModule] = {}
    inner = make_partition_fn(_cfg(engine_cfg), n_params_bytes=pbytes, n_param_inputs=len(state),
                              optimizer=optimizer, records=records)

    def partition_fn(joint: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, **kw: Any):
        fw, bw = inner(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kw)
        graphs["nfo"] = num_fwd_outputs  # type: ignore[assignment]
        for p in bw_passes:
            bw = p(bw, _pass_ctx(engine_cfg, "backward", "backward graph"))
        graphs["bw"] = bw
        return fw, bw

    fw_sink: list[fx.GraphModule] = []
    compiled = aot_function(f, fw_compiler=_compiler("forward", fw_passes, False, engine_cfg, fw_sink, None),
                            bw_compiler=lambda gm, _: gm, partition_fn=partition_fn)
    with fake_mode, fx.traceback.preserve_node_meta():
        compiled(*fake_state, *fake_batch)
    return Captured(fw_sink[-1], graphs["bw"], pbytes, len(state), int(graphs["nfo"]), records)  # type: ignore[arg-type]


def _cfg(engine_cfg: Any) -> Any:
    if engine_cfg is None:
        from graphtrain.config import EngineConfig
        return EngineConfig()
    return engine_cfg


def compile_train_step(model: torch.nn.Module, engine_cfg: Any = None, *, fw_passes: Sequence[GraphPass] = (),
                       bw_passes: Sequence[GraphPass] = (), boxed: bool = True, optimizer: str = "adamw",
                       records: list[RecomputeRecord] | None = None,
                       rewrites: dict[str, int] | None = None,
                       graphs: list[fx.GraphModule] | None = None) -> Callable[..., torch.Tensor]:
    """loss = step(*batch); loss.backward() fills the parameters' .grad. One fixed input shape:
    aot_function does not guard shapes, so build a new step for a new shape."""
    f, state = functional_model(model)
    partition_fn = make_partition_fn(_cfg(engine_cfg), n_params_bytes=param_bytes(state),
                                     n_param_inputs=len(state), optimizer=optimizer, records=records)
    compiled = aot_function(f, fw_compiler=_compiler("forward", fw_passes, boxed, engine_cfg, graphs, rewrites),
                            bw_compiler=_compiler("backward", bw_passes, boxed, engine_cfg, graphs, rewrites),
                            partition_fn=partition_fn)

    def step(*batch: Any) -> torch.Tensor:
        with fx.traceback.preserve_node_meta():  # the first call traces: keep the layer annotations
            return compiled(*state, *batch)
    return step
