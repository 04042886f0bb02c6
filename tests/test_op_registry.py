"""The fused-op registry (kernels/registry.py): every graphtrain op has a complete descriptor beside its kernel,
and recompute, mixed precision, the memory predictor, the dropout split and the passes read their facts from it."""

from __future__ import annotations

import dataclasses
import importlib
import pathlib
import re

import pytest
import torch
import torch.nn.functional as F

import graphtrain
from graphtrain.config.sections import EngineConfig
from graphtrain.kernels import _cpu_ext
from graphtrain.kernels.registry import (
    FORWARD,
    KERNELS,
    OPS,
    PRECISIONS,
    RECOMPUTE,
    ROLES,
    OpDescriptor,
    dispatcher_graphtrain_ops,
    no_workspace,
    op_descriptor,
)
from graphtrain.passes.manager import PassContext, registered_passes
from graphtrain.pipeline.trace import trace_aten_forward

SRC = pathlib.Path(graphtrain.__file__).parent
# where graphtrain makes custom ops: torch.library.custom_op("graphtrain::x"), Library("graphtrain", ...).define
_DEFINES = re.compile(r'custom_op\(\s*"graphtrain::|Library\(\s*"graphtrain"|\.define\(\s*"graphtrain::')


def _import_every_op_module() -> list[str]:
    """Import every graphtrain module that registers a custom op (found in the source), so the dispatcher knows
    them all, whichever modules this test process happened to import already."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if _DEFINES.search(path.read_text()):
            module = "graphtrain." + ".".join(path.relative_to(SRC).with_suffix("").parts)
            importlib.import_module(module)
            found.append(module)
    return found


def test_every_graphtrain_op_has_a_descriptor_and_every_descriptor_an_op():
    modules = _import_every_op_module()
    assert "graphtrain.kernels.attention" in modules and "graphtrain.distributed.tensor_parallel" in modules
    ops = dispatcher_graphtrain_ops()
    assert len(ops) >= 21, ops
    missing = [n for n in ops if op_descriptor(n) is None]
    assert not missing, (
        f"graphtrain ops without an OpDescriptor: {missing}; describe each beside its "
        f"registration (KernelSpec(ops=...) or registry.register_ops)"
    )
    assert not set(OPS) - set(ops), f"descriptors of ops nobody registers: {sorted(set(OPS) - set(ops))}"


def test_descriptor_fields_are_all_required_and_valid():
    for f in dataclasses.fields(OpDescriptor):
        assert f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING, f.name
    _import_every_op_module()
    for name, d in OPS.items():
        assert d.name == name and d.role in ROLES and d.recompute in RECOMPUTE and d.precision in PRECISIONS, d
        assert isinstance(d.random, bool) and callable(d.workspace_bytes) and isinstance(d.cpp, tuple), d
        assert getattr(torch.ops.graphtrain, name).default is not None
    with pytest.raises(TypeError):
        OpDescriptor("x", role=FORWARD, random=False, recompute="cheap", precision="low", cpp=())  # no workspace
    with pytest.raises(ValueError, match="recompute must be one of"):
        OpDescriptor(
            "x",
            role=FORWARD,
            random=False,
            recompute="sometimes",
            precision="low",
            workspace_bytes=no_workspace,
            cpp=(),
        )


def test_every_kernel_file_registers_a_spec_whose_ops_it_defines():
    kernel_files = [
        p.stem
        for p in (SRC / "kernels").glob("*.py")
        if not p.stem.startswith("_") and p.stem not in ("capability", "contract", "flops", "registry")
    ]
    assert sorted(KERNELS) == sorted(kernel_files)
    for name, spec in KERNELS.items():
        assert spec.op_with_role(FORWARD).name == name
        source = (SRC / "kernels" / f"{name}.py").read_text()
        for d in spec.ops:  # the descriptor lives beside the op's registration
            assert f'"graphtrain::{d.name}"' in source, (name, d.name)


def test_cpp_fields_name_real_cpu_ext_functions():
    claimed = {c for d in OPS.values() for c in d.cpp}
    assert claimed <= set(_cpu_ext._DECLS), claimed - set(_cpu_ext._DECLS)
    # every C++ function serves an op, except dropout_mask (the tests' view of the hash mask) and the block_*
    # functions (memory/allocator.py's CPU allocator, not an op)
    assert set(_cpu_ext._DECLS) - claimed == {
        "dropout_mask",
        "block_allocator",
        "block_cache_drain",
        "block_cache_stats",
        "block_cache_prime",
        "block_cache_prime_stop",
        "block_cache_settle",
        "block_cache_record",
    }
    for name in claimed:
        assert re.search(rf"\b{name}\(", _cpu_ext.source()), name


def test_facts_the_old_tables_held():
    """What recompute's op sets, mixed precision's table, seeded.py and the predictor knew before the registry
    (rms_norm's precision was missing: fp32 now, like layer_norm). The kernels' ops only: a user's autograd.Function
    held opaque (passes/autograd_functions.py) is random as far as the passes know, never recomputed, and follows."""
    _import_every_op_module()
    d = OPS.pop("autograd_function")
    try:
        _facts_of_the_kernels_ops()
    finally:
        OPS["autograd_function"] = d
    assert (d.random, d.recompute, d.precision, d.workspace_bytes, d.cpp) == (True, "never", "follow", no_workspace, ())


def _facts_of_the_kernels_ops():
    fwd = {n: d for n, d in OPS.items() if d.role in ("forward", "seeded")}
    assert {n for n, d in OPS.items() if d.random} == {"attention", "bias_dropout_add", "dropout_seed"}
    assert {n for n, d in fwd.items() if d.recompute == "cheap" and not d.random} == {
        "layer_norm",
        "rms_norm",
        "bias_gelu",
        "bias_dropout_add_seeded",
    }
    lce = {
        "linear_cross_entropy",
        "linear_bias_cross_entropy",
        "linear_cross_entropy_logits",
        "linear_bias_cross_entropy_logits",
        "linear_cross_entropy_loss",
    }  # the *_logits ops: a returned head's (passes/returned_heads.py); *_loss: an evaluation graph's
    assert {n for n, d in fwd.items() if d.recompute == "compute-bound" and not d.random} == lce
    assert {n for n, d in fwd.items() if d.recompute == "never"} == {"gemm"}
    assert {n: d.precision for n, d in fwd.items()} == {
        "attention": "low",
        "layer_norm": "fp32",
        "rms_norm": "fp32",
        "cross_entropy": "fp32",
        "linear_cross_entropy": "low",
        "linear_bias_cross_entropy": "low",
        "linear_cross_entropy_logits": "low",
        "linear_bias_cross_entropy_logits": "low",
        "linear_cross_entropy_loss": "low",
        "bias_gelu": "follow",
        "bias_dropout_add": "follow",
        "bias_dropout_add_seeded": "follow",
        "gemm": "follow",
    }
    assert {n for n, d in OPS.items() if d.workspace_bytes is not no_workspace} == {
        "attention",
        "attention_backward",
        "gemm",  # the bf16 "transpose" plan's row-major copy of its first operand
        *lce,
    }
    from graphtrain.memory.seeded import seeded_variants

    g = torch.ops.graphtrain
    assert seeded_variants() == {
        g.bias_dropout_add.default: (g.dropout_seed.default, g.bias_dropout_add_seeded.default)
    }


def _swap(monkeypatch, name: str, **changes):
    monkeypatch.setitem(OPS, name, dataclasses.replace(OPS[name], **changes))


def _node(fn, *inputs, target):
    gm = trace_aten_forward(fn, list(inputs))
    return gm, next(n for n in gm.graph.nodes if getattr(n.target, "overloadpacket", None) is target)


def test_recompute_reads_the_descriptors(monkeypatch):
    from graphtrain.memory import recompute

    x, w, b = torch.randn(4, 8), torch.randn(8), torch.randn(8)
    _, ln = _node(
        lambda x, w, b: torch.ops.graphtrain.layer_norm(x, w, b, 1e-5)[0],
        x,
        w,
        b,
        target=torch.ops.graphtrain.layer_norm,
    )
    assert recompute.is_cheap(ln) and not recompute._never_recomputed(ln) and not recompute.is_random(ln)
    _swap(monkeypatch, "layer_norm", recompute="compute-bound")
    assert not recompute.is_cheap(ln) and recompute._is_compute_intensive(ln)
    _swap(monkeypatch, "layer_norm", recompute="never")
    assert recompute._never_recomputed(ln)
    _swap(monkeypatch, "layer_norm", random=True)
    assert recompute.is_random(ln)


def test_mixed_precision_reads_the_descriptors(monkeypatch):
    """rms_norm (missing from the old table) now runs in fp32 under bf16, as layer_norm does."""
    from graphtrain.passes.mixed_precision import FP32, LOW, apply_mixed_precision_pass, policy_of

    def f(x, w, g):
        return torch.ops.graphtrain.rms_norm(x @ w, g, 1e-6)[0]

    inputs = [torch.randn(4, 8), torch.randn(8, 8), torch.randn(8)]
    gm, rms = _node(f, *inputs, target=torch.ops.graphtrain.rms_norm)
    assert policy_of(rms) == FP32
    gm = apply_mixed_precision_pass(gm, PassContext(EngineConfig(precision="bf16"), "pre_autodiff"))
    rms = next(n for n in gm.graph.nodes if getattr(n.target, "overloadpacket", None) is torch.ops.graphtrain.rms_norm)
    assert rms.args[0].meta["val"].dtype == torch.float32  # the bf16 matmul's output is cast up for the norm
    _swap(monkeypatch, "rms_norm", precision=LOW)
    assert policy_of(rms) == LOW


def test_memory_predictor_reads_the_descriptors(monkeypatch):
    from graphtrain.memory.predict import op_workspace_bytes

    q = torch.randn(2, 2, 16, 8)
    _, att = _node(
        lambda q, k, v: torch.ops.graphtrain.attention(q, k, v, None, 0.35, False, 0.1)[0],
        q,
        q,
        q,
        target=torch.ops.graphtrain.attention,
    )
    # fp32 without a mask: the head-by-head kernel's [HEADS_QB, Sk] block per thread
    from graphtrain.kernels.attention import HEADS_QB

    assert op_workspace_bytes(att) == torch.get_num_threads() * HEADS_QB * 16 * 4
    mask = torch.zeros(16, 16)
    _, att_masked = _node(
        lambda q, k, v: torch.ops.graphtrain.attention(q, k, v, mask, 0.35, False, 0.1)[0],
        q,
        q,
        q,
        target=torch.ops.graphtrain.attention,
    )
    assert op_workspace_bytes(att_masked) == 2 * 2 * 16 * 16 * 4  # with a mask: the dropout path's [B*H, S, S] scores
    _swap(monkeypatch, "attention", workspace_bytes=lambda n: 123)
    assert op_workspace_bytes(att) == 123
    _swap(monkeypatch, "attention", workspace_bytes=lambda n: n.args[99])  # a node without what it reads
    assert op_workspace_bytes(att) == 0


def test_passes_never_merge_or_drop_fused_random_ops():
    """Two dropouts of the same tensor are two masks: once fused, CSE merged them (graphtrain::bias_dropout_add
    carries no RNG tag), and dead-code elimination deleted an unused one (the RNG stream then differs from
    eager's). The random fact now comes from the op's descriptor."""

    def f(x):
        return F.dropout(x, 0.5, True) * F.dropout(x, 0.5, True)

    gm = trace_aten_forward(f, [torch.randn(4, 8)])
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    counts = {}
    for name in ("fuse_bias_dropout_add", "eliminate_common_subexpressions", "eliminate_dead_code"):
        if name == "eliminate_dead_code":  # a fused dropout whose output nobody reads
            with gm.graph.inserting_after(x):
                gm.graph.call_function(torch.ops.graphtrain.bias_dropout_add.default, (x, None, None, 0.5))
        ctx = PassContext(EngineConfig(), "pre_autodiff")
        gm = registered_passes()[name].fn(gm, ctx)
        counts[name] = ctx.rewrites
    fused = [n for n in gm.graph.nodes if n.target is torch.ops.graphtrain.bias_dropout_add.default]
    assert counts == {"fuse_bias_dropout_add": 2, "eliminate_common_subexpressions": 0, "eliminate_dead_code": 0}
    assert len(fused) == 3, gm.code


def test_report_lists_phases_and_fused_ops():
    from graphtrain.config.sections import ModelConfig
    from graphtrain.models import build_model

    torch.manual_seed(0)
    m = build_model(ModelConfig(name="gpt2-tiny", dropout=0.1)).train()
    graphtrain.accelerate(m, provider="aten")
    ids = torch.randint(0, 512, (2, 32))
    m(ids, ids).backward()
    rep = graphtrain.report(m)
    phases = {(p["stage"], p["name"]): p["phase"] for p in rep.passes}
    assert phases[("pre_autodiff", "fuse_attention")] == "fuse"
    assert phases[("backward", "inplace_elementwise")] == "memory"
    fused = {f["name"]: f for f in rep.fused_ops}
    assert fused["attention"]["count"] == 2 and fused["attention"]["random"]
    assert fused["layer_norm"]["precision"] == "fp32"
    text = str(rep)
    assert "pre_autodiff/fuse_epilogue fuse_bias_dropout_add" in text
    assert (
        "attention x2: random, compute-bound, low, attn_heads_available+attn_heads_fwd+attn_probs_fwd+onednn_matmul"
        in text
    )
