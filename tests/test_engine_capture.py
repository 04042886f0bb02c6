"""Capture edge cases: graph breaks, data-dependent code, shape changes, fallback policy, backend name."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
import torch.nn as nn

import graphtrain
from graphtrain.config.fallback import GraphtrainCaptureError, GraphtrainFallbackWarning
from graphtrain.testing import assert_close, assert_grads_close


@pytest.fixture(autouse=True)
def _many_instances():
    # Every test builds new instances of the same classes; Dynamo counts their compiles per code object.
    with torch._dynamo.config.patch(recompile_limit=64):
        yield


class MLP(nn.Module):
    def __init__(self, mode: str = "plain") -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if self.mode == "print":
            print("hidden mean computed")  # a graph break in the middle of forward
        elif self.mode == "item":
            if h.sum().item() > 0:  # a branch on a tensor's value: data-dependent control flow
                h = h * 2
        elif self.mode == "nonzero":
            h = h + h[h.nonzero(as_tuple=True)].sum()  # output shape depends on the data
        return self.b(h)


def _pair(mode, **accel):
    torch.manual_seed(0)
    ref, m = MLP(mode), MLP(mode)
    m.load_state_dict(ref.state_dict())
    return ref, graphtrain.accelerate(m, provider="aten", **accel)


def _step_both(ref, m, x):
    for mod in (ref, m):
        mod.zero_grad(set_to_none=True)
        mod(x).square().mean().backward()
    assert_close(m(x), ref(x), bitwise=True)
    assert_grads_close(m, ref, bitwise=True)


@pytest.mark.parametrize("mode", ["print", "item", "nonzero"])
def test_graph_breaks_fall_back_to_python_with_reason(mode, capsys):
    ref, m = _pair(mode, fallback="silent")
    _step_both(ref, m, torch.randn(4, 8))
    rep = graphtrain.report(m)
    assert len(rep.graph_breaks) >= 1 and len(rep.graphs) >= 2, str(rep)
    assert "graph breaks: " in str(rep)
    if mode == "print":
        assert "hidden mean computed" in capsys.readouterr().out


@pytest.mark.parametrize("mode", ["print", "item"])
def test_fallback_error_raises_capture_error(mode):
    _, m = _pair(mode, fallback="error")
    with pytest.raises(GraphtrainCaptureError, match="engine.fallback=warn"):
        m(torch.randn(4, 8))


def test_a_users_error_is_eagers_error_and_no_fallback():
    _, m = _pair("plain", fallback="warn")
    m(torch.randn(4, 8))
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        m(torch.randn(4, 5))  # the model takes 8 features
    rep = graphtrain.report(m)
    assert not rep.fallbacks and not rep.eager_only


@pytest.mark.parametrize("policy", ["warn", "error"])
def test_a_compiled_graph_that_raises_where_eager_runs_falls_back(policy, monkeypatch):
    """A graph graphtrain got wrong (a pass that built what eager's code does not compute: the DeBERTa attention
    fusion broadcast its mask wrongly) raised a shape error the user never wrote. Eager runs the same call, so the
    module falls back with a warning (or the `error` policy's error) instead of raising it."""
    from graphtrain.frontend import accelerate as api

    ref, m = _pair("plain", fallback=policy)
    x = torch.randn(4, 8)

    def broken(self, args, kwargs):
        raise RuntimeError("shape '[1024, 256]' is invalid for input of size 2097152")

    monkeypatch.setattr(api._CallWrapper, "_run_compiled", broken)
    if policy == "error":
        with pytest.raises(GraphtrainCaptureError, match="raised where eager runs"):
            m(x)
        return
    with pytest.warns(UserWarning, match="compiled graph raised where eager runs"):
        out = m(x)
    assert_close(out, ref(x), bitwise=True)
    rep = graphtrain.report(m)
    assert rep.eager_only and "is invalid for input" in rep.fallbacks[0][1]


def test_a_module_whose_forward_is_torchs_own_is_captured():
    # Dynamo starts no trace in torch.nn's files: nn.Sequential used to run eagerly without a word.
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    m = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    m.load_state_dict(ref.state_dict())
    m = graphtrain.accelerate(m, provider="aten", fallback="error")
    _step_both(ref, m, torch.randn(4, 8))
    rep = graphtrain.report(m)
    assert rep.graphs and not rep.fallbacks, str(rep)


class _Identity(nn.Module):
    def forward(self, x):
        return x


def test_a_call_that_compiles_no_graph_is_reported():
    m = graphtrain.accelerate(_Identity(), provider="aten")
    from graphtrain.config import fallback

    with pytest.warns(fallback.GraphtrainFallbackWarning, match="compiled no graph"):
        m(torch.randn(2))
    assert [part for part, _ in graphtrain.report(m).fallbacks] == ["capture of _Identity"]


def test_a_model_with_an_lstm_says_why_it_runs_eagerly():
    """Dynamo skips a frame that calls nn.LSTM/GRU/RNN, so such a model compiles nothing: the report named no cause
    ("every frame skipped or empty"); it now names the recurrent modules. Training is eager's."""

    class Tagger(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn, self.head = nn.LSTM(8, 16, batch_first=True), nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.rnn(x)[0])

    torch.manual_seed(0)
    ref = Tagger()
    m = graphtrain.accelerate(copy.deepcopy(ref), provider="aten")
    x = torch.randn(2, 5, 8)
    with pytest.warns(GraphtrainFallbackWarning, match="compiled no graph"):
        _step_both(ref, m, x)
    ((_, reason),) = graphtrain.report(m).fallbacks
    assert "recurrent modules (LSTM at rnn)" in reason, reason


def test_shape_change_recompiles_and_is_reported():
    ref, m = _pair("plain", fallback="error")
    for batch in (4, 6):
        _step_both(ref, m, torch.randn(batch, 8))
    rep = graphtrain.report(m)
    assert len(rep.recompiles) == 1 and (6, 8) in rep.recompiles[0]["input_shapes"], str(rep)
    assert "recompiles: 1" in str(rep)


def test_dynamic_shapes_compile_once():
    ref, m = _pair("plain", fallback="error", dynamic=True)
    for batch in (4, 6, 9):
        _step_both(ref, m, torch.randn(batch, 8))
    rep = graphtrain.report(m)
    assert len(rep.graphs) == 1 and not rep.recompiles, str(rep)


def test_past_the_recompile_limit_new_shapes_run_eagerly_and_say_so():
    """Regression: past Dynamo's recompile limit (8 input shapes with engine.dynamic=false: a Hugging Face Trainer's
    dynamic padding gets there) a module ran each new shape eagerly without a word. It is reported once, with the
    fix; the shapes compiled before stay compiled; under fallback=error it is an error."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=2):
        torch.manual_seed(0)
        ref, m = MLP(), MLP()
        m.load_state_dict(ref.state_dict())
        graphtrain.accelerate(m, provider="aten")
        _step_both(ref, m, torch.randn(4, 8))
        _step_both(ref, m, torch.randn(5, 8))
        with pytest.warns(GraphtrainFallbackWarning, match="engine.dynamic=true"):
            _step_both(ref, m, torch.randn(6, 8))  # the third shape: eager, and said so
        _step_both(ref, m, torch.randn(7, 8))
        _step_both(ref, m, torch.randn(4, 8))  # a compiled shape: still compiled
        rep = graphtrain.report(m)
        assert [p for p, _ in rep.fallbacks] == ["recompile limit of MLP"], rep.fallbacks
        assert not rep.eager_only and len(rep.graphs) == 2
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1):
        m = graphtrain.accelerate(MLP(), provider="aten", fallback="error")
        m(torch.randn(4, 8))
        with pytest.raises(GraphtrainCaptureError, match="recompile limit"):
            m(torch.randn(5, 8))


def test_models_of_one_class_each_get_their_own_recompile_budget():
    """Regression: Dynamo's recompile limit counted the compiled code of every accelerated model of one class in the
    process (each has a backend of its own), so the 9th (an in-process sweep, a notebook cell run again) ran
    eagerly. Each accelerate call now has its own budget (torch.compile's isolate_recompiles, torch 2.13 and later);
    a model's own new shapes still count against it."""
    from graphtrain.config.torch_compat import isolated_compile_options

    if not isolated_compile_options():
        pytest.skip(f"torch {torch.__version__}: torch.compile has no isolate_recompiles")
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=2):
        for i in range(4):  # twice the limit
            torch.manual_seed(i)
            ref, m = MLP(), MLP()
            m.load_state_dict(ref.state_dict())
            graphtrain.accelerate(m, provider="aten")
            _step_both(ref, m, torch.randn(4, 8))
            assert m(torch.randn(4, 8)).grad_fn.name() == "CompiledFunctionBackward", i
            assert not graphtrain.report(m).fallbacks, (i, graphtrain.report(m).fallbacks)
        _step_both(ref, m, torch.randn(5, 8))
        with pytest.warns(GraphtrainFallbackWarning, match="engine.dynamic=true"):
            _step_both(ref, m, torch.randn(6, 8))  # its own third shape
    torch._dynamo.reset()


@pytest.mark.parametrize("where", ["block", "head-norm"])
def test_hooks_registered_after_the_first_step_run_and_removed_ones_stop(where):
    """Regression: Dynamo's default guards no module hooks, so a forward hook registered after the first step was
    ignored without a word (and a removed one would have kept running): graphtrain's loss came out as without it.
    Forward, forward-pre and full backward hooks, on a repeated block (compiled once for all blocks) and on another
    submodule: each addition and removal compiles the call again and trains as eager."""
    from graphtrain.config.sections import ModelConfig
    from graphtrain.models import build_model

    def model():
        torch.manual_seed(0)
        return build_model(ModelConfig(name="gpt2-tiny", dropout=0.0))

    def batch(seed):
        ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(seed))
        return {"input_ids": ids, "labels": torch.roll(ids, -1, 1)}

    m, ref = model(), model()
    graphtrain.accelerate(m, provider="aten")
    calls = {"m": 0, "ref": 0}

    def step(i):
        for mod in (m, ref):
            mod.zero_grad(set_to_none=True)
            mod(**batch(i)).backward()
        assert_grads_close(m, ref, atol=1e-6, rtol=1e-5)

    step(0)
    handles = []
    for mod, key in ((m, "m"), (ref, "ref")):
        sub = mod.blocks[1] if where == "block" else mod.ln_f
        handles += [
            sub.register_forward_hook(lambda _m, _a, out: out * 2),
            sub.register_forward_pre_hook(lambda _m, args: (args[0] * 3, *args[1:])),
            sub.register_full_backward_hook(lambda _m, gi, go, k=key: calls.__setitem__(k, calls[k] + 1)),
        ]
    step(1)
    assert calls["m"] == calls["ref"] == 1, calls
    for h in handles:
        h.remove()
    step(2)
    assert calls["m"] == 1 and not graphtrain.report(m).fallbacks


@pytest.mark.parametrize("provider", ["aten", pytest.param("inductor", marks=pytest.mark.slow)])  # inductor: 20 s
def test_a_backward_that_retains_the_graph_after_plain_ones_trains_as_eager(provider):
    """Regression: a backward with ``retain_graph=True`` (two losses backpropagated one after the other, a gradient
    penalty) through a graph whose backward had already run without it raised "compiled with non-empty donated
    buffers" (AOTAutograd's donated buffers; under provider auto at the second step of such a loop, since the
    background compile builds the backward ahead). Eager and plain torch.compile run it."""
    from graphtrain.config.sections import ModelConfig
    from graphtrain.models import build_model

    def model():
        torch.manual_seed(0)
        return build_model(ModelConfig(name="gpt2-tiny", dropout=0.0))

    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": torch.roll(ids, -1, 1)}
    m, ref = model(), model()
    graphtrain.accelerate(m, provider=provider)
    for retain in (False, True, True):
        for mod in (m, ref):
            mod.zero_grad(set_to_none=True)
            loss = mod(**batch)
            loss.backward(retain_graph=retain)
            if retain:
                (loss * 0.5).backward()  # the second backward through the same graph
        assert_grads_close(m, ref, atol=1e-6, rtol=1e-5)
    assert not graphtrain.report(m).fallbacks


class KeysInANewTensor(nn.Module):
    """Writes its parts into a new tensor with in-place copies, as HF DeepSeek-V3 builds its keys: one of the same
    shape, one broadcast along the sequence and one cast from bf16."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 6), nn.Linear(8, 2), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty(*x.shape[:-1], 12)
        out[..., :6].copy_(self.a(x))
        out[..., 6:8].copy_(self.b(x[:, :1]))  # [B, 1, 2] into [B, S, 2]
        out[..., 8:].copy_(self.c(x).to(torch.bfloat16))
        return out.square().mean()


@pytest.mark.parametrize("provider", ["aten", pytest.param("inductor", marks=pytest.mark.slow)])
def test_in_place_copies_into_a_new_tensor_are_differentiated_as_in_eager(provider):
    """Regression: functionalization turns ``x[..., :n].copy_(y)`` into aten.copy, which autograd cannot
    differentiate ("derivative for aten::copy is not implemented"), so the graph ran eagerly (HF DeepSeek-V3)."""
    torch.manual_seed(0)
    ref = KeysInANewTensor()
    m = graphtrain.accelerate(copy.deepcopy(ref), provider=provider, fallback="error")
    x = torch.randn(2, 5, 8)
    for mod in (ref, m):
        mod(x).backward()
    # Inductor computes the bf16 round trip of `c` in fp32, as plain torch.compile does (the same gradients: 0.24%
    # of the largest off eager's); the aten provider runs eager's ops
    tol = dict(rtol=1e-5, atol=1e-6) if provider == "aten" else dict(rtol=1e-2, atol=5e-4)
    assert_grads_close(m, ref, **tol)
    assert not graphtrain.report(m).fallbacks


@pytest.mark.skipif(not importlib.util.find_spec("transformers"), reason="transformers not installed")
def test_dynamic_shapes_on_a_hugging_face_model_compile_once():
    """Regression: under engine.dynamic=true AOTAutograd asks Dynamo to trace a Hugging Face GPT-2 again
    (TensorifyScalarRestartAnalysis), and graphtrain's fallbacks took that request for a failed compile: the model
    ran eagerly. One graph now serves every sequence length, like eager."""
    from graphtrain.bench.families import build_family

    ref, batch = build_family("gpt2", hidden=32, layers=2, vocab=101, batch=2, seq=24, dropout=False)
    m = graphtrain.accelerate(copy.deepcopy(ref), provider="aten", fallback="error", dynamic=True)
    graphs = []
    for length in (24, 17, 9, 13):
        inputs = {k: v[:, :length] for k, v in batch.items()}
        losses = []
        for mod in (ref, m):
            mod.zero_grad(set_to_none=True)
            loss = mod(**inputs).loss
            loss.backward()
            losses.append(loss.detach())
        assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6, name="loss")
        assert_grads_close(m, ref, rtol=1e-4, atol=1e-6)
        graphs.append(len(graphtrain.report(m).graphs))
    rep = graphtrain.report(m)
    # Dynamo may specialize the first call's length and generalize at the second (automatic dynamic); after
    # that one compile (its blocks' graphs) serves every length
    assert not rep.fallbacks and graphs[1] <= 2 * graphs[0] and graphs[1] == graphs[-1], (graphs, str(rep))


@pytest.mark.skipif(not importlib.util.find_spec("transformers"), reason="transformers not installed")
def test_dynamic_shapes_keep_the_fusions_of_a_model_with_dropout():
    """Regression: under engine.dynamic=true the trace to aten failed on any dropout (aten's C++ dropout asked
    torch.func.functionalize's wrapper for a symbolic element count), so a Hugging Face model with dropout ran
    without any pre-autodiff pass (reported as a fallback). Now the symbolic trace fuses what the static one does,
    and with the same seed it computes what the static graphs compute (the fused dropouts draw the same masks)
    at every length, from one graph."""
    from graphtrain.bench.families import build_family

    ref, batch = build_family("gpt2", hidden=32, layers=2, vocab=101, batch=2, seq=24, dropout=True)
    dyn = graphtrain.accelerate(copy.deepcopy(ref), provider="aten", fallback="error", dynamic=True)
    static = graphtrain.accelerate(copy.deepcopy(ref), provider="aten", fallback="error")
    for length in (24, 17, 9):
        inputs = {k: v[:, :length].clone() for k, v in batch.items()}
        losses = []
        for mod in (static, dyn):
            mod.zero_grad(set_to_none=True)
            torch.manual_seed(length)
            loss = mod(**inputs).loss
            loss.backward()
            losses.append(loss.detach())
        assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6, name=f"loss at length {length}")
        assert_grads_close(dyn, static, rtol=1e-4, atol=1e-6)
    rep = graphtrain.report(dyn)
    assert not rep.fallbacks and not rep.recompiles and len(rep.graphs) <= 3 and rep.blocks, str(rep)
    fused = {r["name"]: r["rewrites"] for r in rep.passes if r["stage"] == "pre_autodiff"}
    # per compile: attention with its dropout in both blocks; embedding, attention-output and MLP dropouts
    assert fused["fuse_attention"] >= 2 and fused["fuse_bias_dropout_add"] >= 5 and fused["fuse_bias_gelu"] >= 2, fused


def test_gemm_probe_reads_symbolic_sizes_without_guarding_them():
    """Regression: lower_gemm_onednn's shape probe took int() of a symbolic row count, a guard that made Dynamo
    compile the graph again for every new sequence length under engine.dynamic=true."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from graphtrain.passes import lower_gemm

    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    a = mode.from_tensor(
        torch.randn(96, 32), symbolic_context=StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * 2)
    )
    b = mode.from_tensor(torch.randn(48, 32)).t()
    na, nb = torch.fx.Graph().placeholder("a"), torch.fx.Graph().placeholder("b")
    na.meta["val"], nb.meta["val"] = a, b
    assert lower_gemm._shape(na, nb) == (96, 32, 48, True)
    assert not env.guards and not env.replacements


def test_failing_pass_falls_back_and_is_reported(monkeypatch):
    from graphtrain.passes import cleanup, manager

    def broken(gm, ctx):
        raise RuntimeError("boom")

    monkeypatch.setattr(manager._REGISTRY["remove_noop_ops"], "fn", broken)
    ref, m = _pair("plain", fallback="silent")
    _step_both(ref, m, torch.randn(4, 8))
    rep = graphtrain.report(m)
    failed = [p for p in rep.passes if p["error"]]
    assert failed and "boom" in failed[0]["error"] and "FAILED" in str(rep)
    assert cleanup.remove_noop_ops_pass is not broken


def test_provider_failure_falls_back_to_aten(monkeypatch):
    from graphtrain.runtime import providers

    def broken(*a, **k):
        raise RuntimeError("no compiler here")

    monkeypatch.setitem(providers.PROVIDERS, "inductor", broken)
    torch.manual_seed(0)
    ref, m = MLP(), MLP()
    m.load_state_dict(ref.state_dict())
    # the graph keeps its pre-autodiff passes on the fallback provider; lower_gemm_onednn (Inductor's, numerics-
    # changing) is off so that the aten run stays bitwise equal to eager
    graphtrain.accelerate(m, provider="inductor", fallback="warn", passes={"lower_gemm_onednn": False})
    with pytest.warns(UserWarning, match="no compiler here"):
        _step_both(ref, m, torch.randn(4, 8))
    rep = graphtrain.report(m)
    assert rep.graphs[0]["provider"] == "aten" and rep.fallbacks


def test_the_backend_under_provider_auto_runs_a_graph_no_candidate_compiles_eagerly(monkeypatch):
    """Regression: under torch.compile(backend="graphtrain") with provider auto, a graph that neither aten nor
    Inductor compiled raised BackendCompilerFailed (HF Qwen3-Next in bf16, before its in-place copies were made
    differentiable), where a named provider falls back to the Dynamo graph run eagerly. Now auto does too, said as
    a fallback."""
    from graphtrain.runtime import backend, providers

    def broken(*a, **k):
        raise RuntimeError("no compiler here")

    for name in ("aten", "inductor"):
        monkeypatch.setitem(providers.PROVIDERS, name, broken)
    monkeypatch.setattr(backend, "GLOBAL_STATE", backend.EngineState(backend.GLOBAL_STATE.config))
    torch.manual_seed(0)
    ref, m = MLP(), MLP()
    m.load_state_dict(ref.state_dict())
    compiled = torch.compile(m, backend="graphtrain", options={"provider": "auto", "compile_in_background": False})
    x = torch.randn(4, 8)
    with pytest.warns(UserWarning, match="no candidate compiled"):
        compiled(x).square().mean().backward()
    ref(x).square().mean().backward()
    assert_grads_close(m, ref, bitwise=True)
    assert any("no candidate compiled" in str(f) for f in backend.GLOBAL_STATE.fallbacks)


def test_torch_compile_backend_name_and_entry_point():
    import importlib.metadata as md

    torch.manual_seed(0)
    ref, m = MLP(), MLP()
    m.load_state_dict(ref.state_dict())
    cm = torch.compile(m, backend="graphtrain", options={"provider": "aten"})
    x = torch.randn(4, 8)
    for mod in (ref, cm):
        mod(x).square().mean().backward()
    assert_grads_close(m, ref, bitwise=True)
    eps = md.entry_points(group="torch_dynamo_backends")
    assert any(ep.name == "graphtrain" and ep.value == "graphtrain.runtime.backend:graphtrain_backend" for ep in eps)


class _Erfcx(nn.Module):
    """erfcx after a linear: in bf16 the linear runs in bf16 and erfcx follows its input's dtype (as under
    autocast), but aten has no bf16 CPU kernel for it: graphtrain's graph raises where eager fp32 runs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.special.erfcx(self.lin(x)).sum()


@pytest.mark.parametrize("policy", ["warn", "error"])
def test_the_backend_runs_a_graph_that_raises_where_eager_runs_eagerly(policy):
    """torch.compile(backend="graphtrain") had no fallback at run time: a graph graphtrain got wrong raised at the
    user ("erfcx_cpu" not implemented for 'BFloat16'; HF DeBERTa-v2's mask fill in bf16 did the same). Its first
    call now runs the Dynamo graph eagerly instead, with a warning (or the `error` policy's error), as accelerate
    does for a module; the calls after it run eagerly too."""
    torch.manual_seed(0)
    ref = _Erfcx()
    m = copy.deepcopy(ref)
    cm = torch.compile(m, backend="graphtrain", options={"precision": "bf16", "provider": "aten", "fallback": policy})
    x = torch.randn(4, 8)
    if policy == "error":
        with pytest.raises(GraphtrainCaptureError, match="raised where eager runs"):
            cm(x)
        return
    with pytest.warns(GraphtrainFallbackWarning, match="erfcx_cpu"):
        cm(x).backward()
    ref(x).backward()
    assert_grads_close(m, ref, bitwise=True)
    cm(x).backward()
    ref(x).backward()
    assert_grads_close(m, ref, bitwise=True)


def test_import_is_light_and_the_backend_name_still_resolves():
    """`import graphtrain` leaves Dynamo unloaded (it cost 1.4 s and 140 MB); a fresh process still finds the
    "graphtrain" backend by name, and `accelerate` works, both in the same process."""
    import subprocess
    import sys

    code = (
        "import sys, torch, graphtrain\n"
        "assert 'torch._dynamo' not in sys.modules, 'import graphtrain loaded Dynamo'\n"
        "m = torch.compile(torch.nn.Linear(4, 3), backend='graphtrain', options={'provider': 'aten'})\n"
        "m(torch.randn(2, 4)).sum().backward()\n"
        "from torch._dynamo.backends.registry import _COMPILER_FNS\n"
        "assert 'graphtrain' in _COMPILER_FNS\n"
        "n = graphtrain.accelerate(torch.nn.Linear(4, 3), provider='aten')\n"
        "n(torch.randn(2, 4)).sum().backward()\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_report_str_and_dict():
    _, m = _pair("plain", fallback="error")
    m(torch.randn(4, 8)).sum().backward()
    rep = graphtrain.report(m)
    text = str(rep)
    for section in (
        "time to first step",
        "parameters: trained",
        "graphs captured: 1",
        "graph breaks: 0",
        "recompiles: 0",
        "fallbacks: 0",
        "eliminate_dead_code",
        "saved activations",
    ):
        assert section in text, text
    d = rep.to_dict()
    assert d["params"]["trained"] == sum(p.numel() for p in m.parameters()) and d["first_step_seconds"] > 0


def test_engine_cache_dir_receives_the_compile_cache(tmp_path, monkeypatch):
    """engine.cache_dir is where Inductor's caches go. Regression: importing torch._dynamo writes torch's
    default folder into TORCHINDUCTOR_CACHE_DIR, which the engine took for a user's choice and kept."""
    import os

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    monkeypatch.delenv("_GRAPHTRAIN_SET_CACHE", raising=False)

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return torch.nn.functional.gelu(self.lin(x))

    m = graphtrain.accelerate(Tiny(), provider="inductor", fallback="error", cache_dir=str(tmp_path / "cache"))
    m(torch.randn(4, 8)).sum().backward()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache")
    assert (tmp_path / "cache" / "fxgraph").is_dir()
    # a folder the user chose themselves is kept
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.delenv("_GRAPHTRAIN_SET_CACHE", raising=False)
    graphtrain.accelerate(nn.Linear(2, 2), cache_dir=str(tmp_path / "ours"))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
