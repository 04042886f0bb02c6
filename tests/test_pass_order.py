"""The order passes run in: pinned per stage and provider (it was pinned before passes moved from numeric
`order=` to named phases and before/after constraints, and must not change unnoticed)."""

from __future__ import annotations

import pytest

from graphtrain.config.sections import EngineConfig
from graphtrain.passes.manager import STAGES, pipeline, registered_passes

CLEANUPS = [
    "remove_noop_ops",
    "fold_view_chains",
    "eliminate_common_subexpressions",
    "eliminate_dead_code",
    "inplace_elementwise",
]
DYNAMO = [
    "specialize_static_masks",
    "route_learned_masks_to_math",
    "lift_no_grad_regions",
    "detach_returned_heads",
    "hide_autograd_functions",
]
EVERY_PASS = {
    "dynamo": DYNAMO,
    "pre_autodiff": [
        "fuse_layer_norm",
        "fuse_rms_norm",
        "fuse_attention",
        "fuse_bias_gelu",
        "remove_noop_ops",
        "fold_view_chains",
        "fold_constants",
        "index_as_slice",
        "fuse_bias_dropout_add",
        "fuse_linear_cross_entropy",
        "eliminate_common_subexpressions",
        "fuse_cross_entropy",
        "sparse_lm_head",
        "loss_only_lm_head",
        "eliminate_dead_code",
        "apply_mixed_precision",
        "lower_gelu_tanh",
        "lower_gemm_onednn",
    ],
    "forward": CLEANUPS[:-1] + ["lower_gemm_plans", CLEANUPS[-1]],
    "backward": CLEANUPS[:-1] + ["lower_gemm_plans", CLEANUPS[-1]],
}
DEFAULT_PRE_AUTODIFF = {
    "aten": [n for n in EVERY_PASS["pre_autodiff"] if not n.startswith("lower_")],
    "inductor": [
        "fuse_attention",
        "remove_noop_ops",
        "fold_view_chains",
        "fold_constants",
        "index_as_slice",
        "fuse_bias_dropout_add",
        "fuse_linear_cross_entropy",
        "eliminate_common_subexpressions",
        "sparse_lm_head",
        "loss_only_lm_head",
        "eliminate_dead_code",
        "apply_mixed_precision",
        "lower_gelu_tanh",
        "lower_gemm_onednn",
    ],
    "auto": EVERY_PASS["pre_autodiff"],
}


def names(stage: str, **kw) -> list[str]:
    return [s.name for s in pipeline(stage, EngineConfig(**kw))]


@pytest.mark.parametrize("stage", STAGES)
def test_every_pass_runs_in_the_pinned_order(stage):
    every = {n: True for n in registered_passes()}
    assert names(stage, passes=every) == EVERY_PASS[stage]


@pytest.mark.parametrize("provider", ["aten", "inductor", "auto"])
def test_default_pipelines_per_provider(provider):
    assert names("pre_autodiff", provider=provider) == DEFAULT_PRE_AUTODIFF[provider]
    assert names("dynamo", provider=provider) == DYNAMO  # every provider gets the Dynamo graph's rewrites
    for stage in ("forward", "backward"):  # the bf16 GEMM plans under Inductor (and auto, until it resolves)
        assert names(stage, provider=provider) == (CLEANUPS if provider == "aten" else EVERY_PASS[stage])


def test_switching_passes_off_keeps_the_others_order():
    off = {"fold_view_chains": False, "fuse_linear_cross_entropy": False, "apply_mixed_precision": False}
    want = [n for n in EVERY_PASS["pre_autodiff"] if n not in off]
    assert names("pre_autodiff", passes={**{n: True for n in registered_passes()}, **off}) == want


@pytest.fixture
def temporary_passes():
    """Register test-only passes (name -> register_pass kwargs), removed afterwards."""
    from graphtrain.passes.manager import _REGISTRY, register_pass

    added = []

    def add(name: str, **kw):
        def fn(gm, ctx):
            return gm

        fn.__name__ = fn.__qualname__ = f"{name}_pass"
        register_pass("pre_autodiff", **kw)(fn)
        added.append(name)

    yield add
    for name in added:
        _REGISTRY.pop(name, None)


def test_constraints_place_a_pass_inside_its_phase(temporary_passes):
    temporary_passes("aa_check_for_test", phase="simplify", after="fold_view_chains", before="fold_constants")
    order = names("pre_autodiff", passes={n: True for n in registered_passes()})
    assert order[order.index("fold_view_chains") + 1] == "aa_check_for_test"
    assert order.index("aa_check_for_test") + 1 == order.index("fold_constants")


def test_ordering_errors_are_clear(temporary_passes):
    with pytest.raises(
        ValueError, match="unknown pass phase 'fusion'; phases, in order: masks, grad, opaque, fuse, simplify"
    ):
        temporary_passes("bad_phase_for_test", phase="fusion")
    temporary_passes("cycle_a_for_test", phase="fuse", after="cycle_b_for_test")
    temporary_passes("cycle_b_for_test", phase="fuse", after="cycle_a_for_test")
    with pytest.raises(ValueError, match="passes cycle_a_for_test, cycle_b_for_test .* form a cycle"):
        names("pre_autodiff")


def test_a_run_of_some_phases_names_them_right():
    import torch

    from graphtrain.passes.manager import PassContext, run_pipeline

    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"unknown pass phases \['mask'\]; phases, in order: masks, grad"):
        run_pipeline(gm, PassContext(EngineConfig(), "dynamo"), phases=("mask",))
    ctx = PassContext(EngineConfig(), "dynamo")
    run_pipeline(gm, ctx, phases=("opaque",))
    assert [r.name for r in ctx.records] == ["hide_autograd_functions"]


def test_unknown_or_contradicting_constraints_are_errors(temporary_passes):
    from graphtrain.passes.manager import _REGISTRY

    temporary_passes("typo_for_test", phase="fuse", after="fuse_layernorm")
    with pytest.raises(ValueError, match="ordered against 'fuse_layernorm', which is not a registered pass"):
        names("forward")  # checked whatever the stage: a typo never goes unnoticed
    _REGISTRY.pop("typo_for_test")
    temporary_passes("early_for_test", phase="fuse", after="apply_mixed_precision")
    with pytest.raises(ValueError, match="phase 'fuse'.* after 'apply_mixed_precision' .*phase 'precision'"):
        names("pre_autodiff")


def test_pass_modules_do_not_import_each_other():
    """Shared helpers live in fuse_utils.py / graph_utils.py (and the manager); a pass module never imports from
    another pass module."""
    import pathlib
    import re

    import graphtrain.passes as pkg

    folder = pathlib.Path(pkg.__file__).parent
    shared = {"manager", "fuse_utils", "graph_utils"}
    offenders = []
    for path in folder.glob("*.py"):
        for m in re.findall(r"(?:from|import)\s+graphtrain\.passes\.(\w+)", path.read_text()):
            if m not in shared:
                offenders.append(f"{path.name} imports passes.{m}")
    assert not offenders, offenders


def test_a_pass_that_fails_after_changing_the_graph_leaves_the_graph_from_before_it():
    """run_pipeline's backup (built with the graph module's own class: the lazy one Dynamo and AOTAutograd hand over)
    is what runs after a pass that rewrote part of the graph and then raised: the step is bitwise the step without
    that pass, and the fallback names it."""
    import copy
    import operator

    import torch
    import torch.fx as fx

    import graphtrain
    from graphtrain.config.sections import ModelConfig
    from graphtrain.models import build_model
    from graphtrain.passes.manager import _REGISTRY, register_pass

    def half_done_for_test_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
        for n in list(gm.graph.nodes):  # doubles every getitem's users' input, then fails halfway through the pass
            if n.op == "call_function" and n.target is operator.getitem and n.users:
                with gm.graph.inserting_after(n):
                    doubled = gm.graph.call_function(torch.ops.aten.mul.Tensor, (n, 2.0))
                doubled.meta["val"] = n.meta.get("val")
                n.replace_all_uses_with(doubled, delete_user_cb=lambda u, d=doubled: u is not d)
                ctx.count()
        raise RuntimeError("half done")

    register_pass("pre_autodiff", phase="fuse", after="fuse_layer_norm")(half_done_for_test_pass)
    try:
        torch.manual_seed(0)
        ref = build_model(ModelConfig(name="gpt2-tiny", dropout=0.0), vocab_size=512)
        ids = torch.randint(0, 512, (2, 16))
        kw = dict(provider="aten", compile_blocks=False, fallback="warn")
        runs = {}
        for on in (False, True):
            torch._dynamo.reset()
            m = graphtrain.accelerate(copy.deepcopy(ref), passes={"half_done_for_test": on}, **kw)
            if on:
                with pytest.warns(UserWarning, match="half_done_for_test"):
                    loss = m(ids, ids)
            else:
                loss = m(ids, ids)
            loss.backward()
            runs[on] = (loss.detach(), [p.grad for p in m.parameters()], graphtrain.report(m))
        assert any(part == "pass half_done_for_test" for part, _ in runs[True][2].fallbacks), runs[True][2].fallbacks
        assert torch.equal(runs[True][0], runs[False][0])
        assert all(torch.equal(a, b) for a, b in zip(runs[True][1], runs[False][1]))
    finally:
        _REGISTRY.pop("half_done_for_test", None)
