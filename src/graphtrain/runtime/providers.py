"""Execution providers: what runs the partitioned forward/backward graphs.

Both providers take the optimized pre-autodiff aten graph and let AOTAutograd build the gradient graph
(we never write autodiff), then run graphtrain's ``forward``/``backward`` stage passes on the partitioned
graphs.

- ``aten``: the pipeline's autodiff stage (pipeline/stages.py ``autodiff``): ``aot_module_simplified`` with no
  decompositions, so the graphs hold the same aten ops eager autograd would run; fw/bw compilers run our stage
  passes and execute the FX code op by op. It is the reference: deterministic and, with the RNG untouched,
  bitwise equal to eager.
- ``inductor``: ``compile_fx`` on the optimized aten graph. We chose this over calling ``compile_fx_inner``
  per fw/bw graph ourselves because compile_fx brings Inductor's decomposition table, joint-graph passes,
  min-cut partitioner, AOTAutograd cache and FX-graph cache, which a hand-built pipeline would have to
  replicate (and keep replicating across torch versions). Our forward/backward passes ride in as
  ``post_grad_custom_post_pass``: a ``CustomGraphPass`` whose ``uuid()`` hashes the pass sources and
  config, which keeps the compile cache valid. ``fallback_random=True`` keeps eager's RNG for dropout
  (MEASURED.md: Inductor's generated RNG costs ~3x here) and makes dropout masks match eager bitwise.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

import graphtrain.memory.predict as predict
import graphtrain.memory.recompute as recompute
import graphtrain.memory.rewrites as rewrites
import graphtrain.memory.seeded as seeded
from graphtrain.config.fallback import report_fallback
from graphtrain.config.sections import EngineConfig
from graphtrain.kernels import capability
from graphtrain.memory.predict import predict_peak
from graphtrain.passes.graph_utils import has_random_tag, views_as_reshapes
from graphtrain.passes.manager import pipeline
from graphtrain.pipeline.cache import source_digest
from graphtrain.pipeline.job import CompileJob
from graphtrain.pipeline.stages import StepLayout, autodiff, partition_fn, run_passes, user_outputs
from graphtrain.pipeline.stages import layout as step_layout
from graphtrain.pipeline.state import EngineState, GraphRecord


def resolve_provider(config: EngineConfig, example_inputs: Sequence[Any]) -> str:
    """`auto` -> the measured-fastest provider for the device of the graph's inputs: inductor.

    Measured on gpt2-mini batch 16 seq 128 dropout 0.1, 2-core Xeon with AMX, each variant its own process,
    median of 8 steps of `graphtrain.accelerate(model, provider=..., precision=...)` (`graphtrain bench small`
    reproduces the default against eager and torch.compile):
    bf16: inductor 0.160 s/step vs aten 0.274 (eager fp32 0.40, eager autocast 0.278, compile+autocast
    0.22); fp32: inductor 0.37 vs aten 0.36 (eager 0.40, torch.compile 0.38). Inductor's cold compile is
    ~15 s vs ~2.5 s for aten; its FX-graph cache makes the second run start in seconds.
    """
    if config.provider != "auto":
        return config.provider
    return "inductor"


class SlowPrecisionWarning(UserWarning):
    """The requested precision runs much slower than fp32 on this machine."""


_WARNED_SLOW: set[str] = set()


def _device_of(example_inputs: Sequence[Any]) -> str:
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            return x.device.type
    return "cpu"


def resolve_runtime(config: EngineConfig, example_inputs: Sequence[Any]) -> EngineConfig:
    """`config` with what the graph's device decides filled in: the provider (`auto` -> resolve_provider) and
    the precision (`auto` -> bf16 where the hardware has it, else fp32). bf16 asked for on a device without
    native bf16 runs as asked, with one warning saying what to use instead."""
    device = _device_of(example_inputs)
    precision = capability.resolve_precision(config.precision, device)
    if precision == "bf16":
        fast, why = capability.bf16_is_fast(device)
        if not fast and device not in _WARNED_SLOW:
            _WARNED_SLOW.add(device)
            warnings.warn(
                f"graphtrain: precision=bf16 will be much slower than fp32 here: {why}. Use "
                f"engine.precision=fp32, or auto (bf16 only where the hardware has it)",
                SlowPrecisionWarning,
                stacklevel=2,
            )
    return dataclasses.replace(config, provider=resolve_provider(config, example_inputs), precision=precision)


def predict_memory(fw: fx.GraphModule, bw: fx.GraphModule, layout: StepLayout, rec: GraphRecord) -> None:
    """Store predict_peak's estimate (AdamW, boxed backward) of a step through this graph on `rec`."""
    try:
        est = predict_peak(
            fw,
            bw,
            layout.n_params_bytes,
            optimizer="adamw",
            num_user_outputs=max(user_outputs(fw, bw), 1),
            n_param_inputs=layout.n_param_inputs,
            batch_inputs=layout.batch_inputs,
        )
    except Exception as e:  # noqa: BLE001 - an estimate only; say why it is missing
        rec.notes.append(f"peak-memory prediction failed: {type(e).__name__}: {str(e)[:200]}")
        return
    rec.predicted_memory = dict(
        peak=est.peak,
        peak_phase=est.peak_phase,
        params=est.params,
        grads=est.grads,
        optimizer_state=est.optimizer_state,
        batch_inputs=est.inputs,
        saved_activations=est.saved_activations,
        forward_graph_peak=est.forward_peak,
        backward_graph_peak=est.backward_peak,
        optimizer_temp=est.optimizer_temp,
        phase_totals=dict(est.phase_totals),
        peak_node=dict(est.peak_node),
        optimizer="adamw",
    )


def compile_aten(job: CompileJob) -> Callable[..., Any]:
    """The pipeline's autodiff stage as is (FX code run op by op) on the job's pre-autodiff graph, with the step's
    peak memory predicted."""
    rec = job.rec
    return autodiff(
        job.gm,
        job.example_inputs,
        job.config,
        job.state,
        rec,
        on_graphs=lambda fw, bw, lay: predict_memory(fw, bw, lay, rec),
    )


class StagePasses(CustomGraphPass):
    """graphtrain's forward/backward passes as an Inductor post-grad pass (cache-safe through uuid())."""

    def __init__(
        self, config: EngineConfig, rec: GraphRecord, state: EngineState, layout: StepLayout | None = None
    ) -> None:
        self.config, self.rec, self.state, self.layout = config, rec, state, layout
        self._forward: fx.GraphModule | None = None

    def __call__(self, graph: fx.Graph) -> None:
        gm = graph.owning_module
        stage = (
            "backward"
            if any(n.op == "placeholder" and n.name.startswith("tangents_") for n in graph.nodes)
            else "forward"
        )
        out = run_passes(gm, stage, self.config, self.state, self.rec)
        if out is not gm:  # a pass failed and the pipeline handed back its backup: restore it in place
            _replace_graph(graph, out.graph)
        if self.layout is not None:  # predict from the post-grad graphs (Inductor plans buffers below them)
            if stage == "forward":
                self._forward = gm
            elif self._forward is not None:
                predict_memory(self._forward, gm, self.layout, self.rec)
                self._forward = None

    def uuid(self) -> bytes:
        # graphtrain's sources as the pass cache keys them (kernels included): Inductor's AOTAutograd cache keys the
        # graph before autodiff, so a fused op's changed backward formula (kernels/) would otherwise load the stale
        # backward graph compiled with the old one.
        h = hashlib.sha256(source_digest().encode())
        # The vector ISA Inductor generates C++ for: its own keys leave it out (torch 2.13 hashes CUDA device facts
        # only), and the generated source is compiled again at load time with the loading process's ISA flags. Code
        # generated for AVX2 (8 floats a vector), loaded by a process on AVX-512 (16 a vector), wrote past its buffers:
        # "double free or corruption", seen after a run under ATEN_CPU_CAPABILITY=avx2 shared the cache folder; a cache
        # shared between machines of different CPUs would do the same, or worse (AVX-512 code on an AVX2 CPU).
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        h.update(f"vec isa: {pick_vec_isa()}".encode())
        for stage in ("forward", "backward"):
            for spec in pipeline(stage, self.config):
                h.update(f"{stage}:{spec.name}:".encode())
                h.update(inspect.getsource(inspect.getmodule(spec.fn)).encode())
        return h.digest()


def _inductor_partitioner(config: EngineConfig, layout: StepLayout, rec: GraphRecord, state: EngineState) -> Any:
    """graphtrain's recompute partitioner as Inductor's ``custom_partitioner_fn`` (runs after Inductor's
    joint-graph passes, in place of its min-cut partitioner), cache-safe through uuid()."""
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    class RecomputePartitioner(CustomPartitionerFn):
        def __init__(self) -> None:
            self.fn = partition_fn(config, state, rec, layout)

        def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kw: Any):
            return self.fn(gm, joint_inputs, **kw)

        def uuid(self) -> bytes:
            h = hashlib.sha256()
            for mod in (recompute, rewrites, predict, seeded):
                h.update(inspect.getsource(mod).encode())
            # auto's choice depends on the budget and the predicted persistent state
            h.update(
                repr(
                    (
                        config.recompute,
                        config.memory_budget,
                        layout.n_params_bytes,
                        layout.n_param_inputs,
                        layout.batch_inputs,
                    )
                ).encode()
            )
            return h.digest()

        def __reduce__(self) -> tuple[Any, tuple[bytes]]:
            # Inductor's FX-graph cache key pickles its whole config, this object included (torch 2.13 does not
            # leave custom_partitioner_fn out as it does the custom passes): pickled as its uuid, the key changes
            # exactly when the partition would, and the cache works with recompute on.
            return _PartitionerIdentity, (self.uuid(),)

        def __deepcopy__(self, memo: dict) -> Any:  # a config copy keeps the working partitioner, not its identity
            return self

    return RecomputePartitioner()


class _PartitionerIdentity:
    """What a pickled recompute partitioner becomes: its uuid, enough for a cache key, not a partitioner."""

    def __init__(self, uuid: bytes) -> None:
        self.uuid = uuid

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"graphtrain's recompute partitioner {self.uuid.hex()[:12]} was restored from a pickle, "
            f"which keeps only its cache identity; it cannot partition"
        )


def _replace_graph(graph: fx.Graph, new: fx.Graph) -> None:
    for n in reversed(list(graph.nodes)):
        graph.erase_node(n)
    val_map: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(new, val_map)
    graph.output(out)


def compile_inductor(job: CompileJob) -> Callable[..., Any]:
    """``compile_fx`` on the job's pre-autodiff graph. recompute=none keeps Inductor's own min-cut partition: it
    recomputes only ops it fuses into backward kernels, which costs no extra kernel and saves memory, so there is nothing for `none` to switch off.
    selective|full|auto replace it with graphtrain's recompute partitioner (Inductor's
    ``custom_partitioner_fn``, run after Inductor's joint-graph passes), so the modes, the budget and the
    decision records are the aten provider's. A torch without that hook reports the mode once through the
    fallback policy and runs Inductor's min-cut."""
    import torch._inductor.config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    gm, example_inputs, config, rec, state = job.gm, job.example_inputs, job.config, job.rec, job.state
    check_inductor(gm, example_inputs)
    layout = step_layout(gm, example_inputs, rec.input_kinds)
    patches: dict[str, Any] = {
        "fallback_random": True,
        "post_grad_custom_post_pass": StagePasses(config, rec, state, layout),
    }
    rec.partitioner = "min_cut (inductor)"  # with fusion, recomputing pointwise ops is nearly free
    if config.recompute != "none":
        if hasattr(inductor_config, "custom_partitioner_fn"):
            patches["custom_partitioner_fn"] = _inductor_partitioner(config, layout, rec, state)
            rec.partitioner = f"min_cut (recompute={config.recompute})"
        else:
            report_fallback(
                f"recompute={config.recompute} under the inductor provider",
                f"torch {torch.__version__} has no inductor config custom_partitioner_fn",
                config,
                what="is not applied (Inductor's min-cut partition runs)",
                sink=state.fallbacks,
            )
    return compile_fx(views_as_reshapes(gm), list(example_inputs), config_patches=patches)


class UnsuitableProvider(RuntimeError):
    """A provider that compiles but is known to run this graph wrongly. Under provider auto it is left out with a
    note (a decision, not a failure); under a named provider it falls back like any compile error."""


def check_inductor(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    """Raise UnsuitableProvider where Inductor is known to run `gm` wrongly (every Inductor compile asks first)."""
    aten_random = _aten_random_ops(gm, example_inputs)
    if aten_random:
        # Seen with torch 2.13 on CPU (a GPT-2 block with dropout fusion switched off): Inductor fused the fill of
        # a dropout mask's keep probability with the kernel that multiplies by the mask and ran the fallback
        # bernoulli_ after it, so the forward applied no dropout and the backward used the real mask. graphtrain's
        # own dropout ops (fuse_bias_dropout_add, fuse_attention: on by default) draw inside their kernels and
        # are not affected; aten's random ops are not given to Inductor on CPU.
        raise UnsuitableProvider(
            f"the graph holds ATen random ops ({', '.join(aten_random)}): Inductor on CPU can run the in-place "
            f"bernoulli_ after the kernel that reads its mask (a silently wrong dropout). Keep "
            f"engine.passes.fuse_bias_dropout_add and fuse_attention on (graphtrain's dropout), or use "
            f"engine.provider=aten"
        )


def compile_step_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], provider: str) -> Any:
    """A graph that is a whole training step already (forward, autograd and the optimizer update traced together:
    frontend/compile_step.py) as `provider` runs it: ``inductor`` compiles it after the provider's checks, with
    eager's RNG (fallback_random); ``aten`` runs the FX graph op by op. No stage passes or partitioner: the
    gradients are graph values, there is no backward graph to build."""
    if provider == "inductor":
        from torch._inductor.compile_fx import compile_fx

        check_inductor(gm, example_inputs)
        with torch._inductor.config.patch(fallback_random=True):
            return compile_fx(views_as_reshapes(gm), list(example_inputs))
    if provider != "aten":
        raise ValueError(f"compile_step_graph: provider {provider!r} is not one of inductor, aten; pass one of them")
    return views_as_reshapes(gm)  # a view recorded against a fake's strides (HF Qwen3-Next's backward)


# Functional samplers that return a fresh tensor: under fallback_random Inductor calls them as they are, one extern
# call ordered by its data like any other, and does not decompose them into the fill + in-place bernoulli_ pair
# that it misordered. Stochastic depth (timm's and Hugging Face's drop_path: Swin, ViT variants) draws with
# aten.rand. tests/test_inductor_random.py checks forward and backward against eager under the same seed.
_FUNCTIONAL_SAMPLERS = frozenset({"rand", "randn", "rand_like", "randn_like"})


def _aten_random_ops(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> list[str]:
    """The distinct ATen random ops (nondeterministic_seeded) of a CPU graph that Inductor may misorder; an SDPA
    kernel called with dropout_p 0 samples nothing and is not one, and the functional samplers are safe."""
    if any(isinstance(x, torch.Tensor) and x.device.type != "cpu" for x in example_inputs):
        return []
    return sorted(
        {
            str(n.target)
            for n in gm.graph.nodes
            if n.op == "call_function"
            and has_random_tag(n)
            and n.target.namespace == "aten"
            and n.target._opname not in _FUNCTIONAL_SAMPLERS
        }
    )


PROVIDERS = {"aten": compile_aten, "inductor": compile_inductor}
