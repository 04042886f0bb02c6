"""Execution providers: what runs the partitioned forward/backward graphs.

Both providers take the optimized pre-autodiff aten graph and let AOTAutograd build the gradient graph
(we never write autodiff), then run graphtrain's ``forward``/``backward`` stage passes on the partitioned
graphs.

- ``aten``: ``aot_module_simplified`` with no decompositions, so the graphs hold the same aten ops eager
  autograd would run; fw/bw compilers run our stage passes and execute the FX code op by op. It is the
  reference: deterministic and, with the RNG untouched, bitwise equal to eager.
- ``inductor``: ``compile_fx`` on the optimized aten graph. We chose this over calling ``compile_fx_inner``
  per fw/bw graph ourselves because compile_fx brings Inductor's decomposition table, joint-graph passes,
  min-cut partitioner, AOTAutograd cache and FX-graph cache, which a hand-built pipeline would have to
  replicate (and keep replicating across torch versions). Our forward/backward passes ride in as
  ``post_grad_custom_post_pass``: a ``CustomGraphPass`` whose ``uuid()`` hashes the pass sources and
  config, which keeps the compile cache valid. ``fallback_random=True`` keeps eager's RNG for dropout
  (MEASURED.md: Inductor's generated RNG costs ~3x here) and makes dropout masks match eager bitwise.
"""
from __future__ import annotations

import hashlib
import inspect
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from graphtrain.config import EngineConfig
from graphtrain.engine.state import EngineState, GraphRecord
from graphtrain.passes.manager import PassContext, op_counts, pipeline, run_pipeline


def resolve_provider(config: EngineConfig, example_inputs: Sequence[Any]) -> str:
    """`auto` -> the measured-fastest provider for the device of the graph's inputs.

    NOT YET MEASURED on this machine: the first `python -m graphtrain.bench.step --model gpt2-small
    --variants eager,compile,graphtrain,graphtrain-aten` run timed out at 25 min under a load average of 10
    (2 cores shared by 5 engineers). Until it is measured, auto = inductor (eager RNG via fallback_random),
    on the reasoning that it runs the same GEMMs as aten plus fused pointwise/reduction kernels.
    """
    if config.provider != "auto":
        return config.provider
    return "inductor"


def _stage_passes(gm: fx.GraphModule, stage: str, config: EngineConfig, rec: GraphRecord,
                  state: EngineState, example_inputs: Sequence[Any]) -> fx.GraphModule:
    ctx = PassContext(config=config, stage=stage, graph_name=rec.name, example_inputs=list(example_inputs))
    gm = run_pipeline(gm, ctx)
    state.passes.extend(ctx.records)
    n_ops = sum(op_counts(gm).values())
    if stage == "forward":
        rec.ops_forward = n_ops
    else:
        rec.ops_backward = n_ops
        _record_backward(gm, rec)
    return gm


def _record_backward(gm: fx.GraphModule, rec: GraphRecord) -> None:
    """Saved activations are the backward's non-tangent inputs that are not forward inputs (primals_*);
    gradients computed are its non-None outputs, aligned with the forward inputs."""
    saved_bytes, saved = 0, 0
    for n in gm.graph.nodes:
        if n.op != "placeholder" or n.name.startswith(("tangents_", "primals_")):
            continue
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor):
            saved += 1
            numel = v.numel()
            saved_bytes += int(numel) * v.element_size() if isinstance(numel, int) else 0
    rec.saved_activation_bytes, rec.saved_tensors = saved_bytes, saved
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    grads = list(out.args[0]) if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    rec.grads_computed = sum(g is not None for g in grads)
    kinds = rec.input_kinds
    if len(grads) >= len(kinds):
        offset = len(grads) - len(kinds)  # folded constants (module buffers) come first
        rec.frozen_inputs_with_grad = sum(grads[offset + i] is not None for i, k in enumerate(kinds)
                                          if k in ("frozen", "buffer"))


def _partitioner(config: EngineConfig) -> tuple[str, Callable[..., Any]]:
    from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition
    # min-cut saves fewer activations (it recomputes cheap pointwise ops in backward). Without a fuser each
    # recomputed op is one more kernel, so the aten provider keeps the default partition (saves what the
    # backward needs, like eager autograd) unless the user asked for recompute.
    if config.recompute != "none":
        return "min_cut", min_cut_rematerialization_partition
    return "default", default_partition


def compile_aten(gm: fx.GraphModule, example_inputs: Sequence[Any], config: EngineConfig, rec: GraphRecord,
                 state: EngineState) -> Callable[..., Any]:
    from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func

    def fw_compiler(fgm: fx.GraphModule, ins: Sequence[Any]) -> Callable[..., Any]:
        fgm = _stage_passes(fgm, "forward", config, rec, state, ins)
        return make_boxed_func(fgm.forward)

    def bw_compiler(bgm: fx.GraphModule, ins: Sequence[Any]) -> Callable[..., Any]:
        bgm = _stage_passes(bgm, "backward", config, rec, state, ins)
        return make_boxed_func(bgm.forward)

    rec.partitioner, partition_fn = _partitioner(config)
    return aot_module_simplified(gm, example_inputs, fw_compiler=fw_compiler, bw_compiler=bw_compiler,
                                 partition_fn=partition_fn, decompositions={})


class StagePasses(CustomGraphPass):
    """graphtrain's forward/backward passes as an Inductor post-grad pass (cache-safe through uuid())."""

    def __init__(self, config: EngineConfig, rec: GraphRecord, state: EngineState) -> None:
        self.config, self.rec, self.state = config, rec, state

    def __call__(self, graph: fx.Graph) -> None:
        gm = graph.owning_module
        stage = "backward" if any(n.op == "placeholder" and n.name.startswith("tangents_")
                                  for n in graph.nodes) else "forward"
        out = _stage_passes(gm, stage, self.config, self.rec, self.state, [])
        if out is not gm:  # a pass failed and the pipeline handed back its backup: restore it in place
            _replace_graph(graph, out.graph)

    def uuid(self) -> bytes:
        h = hashlib.sha256()
        for stage in ("forward", "backward"):
            for spec in pipeline(stage, self.config):
                h.update(f"{stage}:{spec.name}:".encode())
                h.update(inspect.getsource(inspect.getmodule(spec.fn)).encode())
        return h.digest()


def _replace_graph(graph: fx.Graph, new: fx.Graph) -> None:
    for n in reversed(list(graph.nodes)):
        graph.erase_node(n)
    val_map: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(new, val_map)
    graph.output(out)


def compile_inductor(gm: fx.GraphModule, example_inputs: Sequence[Any], config: EngineConfig, rec: GraphRecord,
                     state: EngineState) -> Callable[..., Any]:
    from torch._inductor.compile_fx import compile_fx

    rec.partitioner = "min_cut"  # compile_fx's choice: with fusion, recomputing pointwise ops is nearly free
    patches = {"fallback_random": True, "post_grad_custom_post_pass": StagePasses(config, rec, state)}
    return compile_fx(gm, list(example_inputs), config_patches=patches)


PROVIDERS = {"aten": compile_aten, "inductor": compile_inductor}
