"""Repeated blocks compile once (pipeline/blocks.py): parity with eager, one block graph for any depth, the
fallbacks, and Hugging Face models (no KV cache built in training)."""

from __future__ import annotations

import copy
import importlib.util
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphtrain
from graphtrain.config.fallback import GraphtrainFallbackWarning
from graphtrain.testing import assert_close, assert_grads_close

HAS_HF = importlib.util.find_spec("transformers") is not None
# The engine's own passes only: fused kernels draw dropout masks their own way (not eager's stream).
ENGINE_ONLY = {
    name: False
    for name in (
        "fuse_attention",
        "fuse_cross_entropy",
        "fuse_linear_cross_entropy",
        "fuse_bias_dropout_add",
        "fuse_bias_gelu",
        "fuse_layer_norm",
        "fuse_rms_norm",
        "inplace_elementwise",
    )
}


class Block(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.ln, self.fc, self.out = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.out(F.gelu(self.fc(self.ln(x)))))


class Stack(nn.Module):
    """Blocks called from a plain `for block in self.blocks` loop (Dynamo's block reuse mis-binds weights there)."""

    def __init__(self, layers: int = 3, d: int = 32, vocab: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), idx.flatten())


def _pair(layers: int = 3, **accel):
    torch.manual_seed(0)
    ref = Stack(layers).train()
    m = Stack(layers).train()
    m.load_state_dict(ref.state_dict())
    accel.setdefault("passes", ENGINE_ONLY)
    accel.setdefault("fallback", "error")
    return ref, graphtrain.accelerate(m, provider="aten", **accel)


def _step_bitwise(ref, m, idx, seed: int) -> None:
    """One training step of each model on `idx` under the same seed: loss and gradients equal to the bit."""
    losses = []
    for mod in (ref, m):
        mod.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        loss = mod(idx)
        loss.backward()
        losses.append(loss.detach())
    assert_close(losses[1], losses[0], name=f"loss (step {seed}, length {idx.shape[1]})", bitwise=True)
    assert_grads_close(m, ref, bitwise=True)


def _steps(ref, m, steps: int = 2):
    idx = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    for seed in range(steps):
        _step_bitwise(ref, m, idx, seed)


def test_blocks_compile_once_and_match_eager_bitwise():
    ref, m = _pair(layers=3)
    _steps(ref, m)
    rep = graphtrain.report(m)
    assert rep.blocks == ["blocks (3 x Block)"], str(rep)
    block = [g for g in rep.graphs if g["calls_per_step"] > 1]
    assert len(block) == 1 and block[0]["calls_per_step"] == 3, str(rep)
    assert "compiled block by block" in str(rep) and "runs 3 times per step" in str(rep)
    assert not rep.fallbacks


def test_graph_count_does_not_grow_with_depth():
    # 10 layers: past torch's default of 8 reuse entries per region, which failed the capture of any deeper model
    # that is traced block by block (this loop-called Stack is; pipeline/blocks.py _region)
    counts = {}
    for layers in (2, 10):
        ref, m = _pair(layers=layers)
        _steps(ref, m, steps=1)
        rep = graphtrain.report(m)
        counts[layers] = (len(rep.graphs), sum(g["calls_per_step"] for g in rep.graphs))
    assert counts[2][0] == counts[10][0], counts  # the same graphs compiled ...
    assert counts[10][1] - counts[2][1] == 8, counts  # ... the block's run eight more times


def test_dynamic_shapes_compile_each_block_once_for_every_length():
    """engine.dynamic=true used to compile the whole model as one graph (its compile grew with the depth). The
    blocks now compile once for every length: bitwise eager at three lengths, one block graph, no recompile."""
    ref, m = _pair(layers=3, dynamic=True)
    for length in (8, 5, 11):
        _step_bitwise(
            ref, m, torch.randint(0, 64, (2, length), generator=torch.Generator().manual_seed(length)), seed=length
        )
    rep = graphtrain.report(m)
    assert rep.blocks == ["blocks (3 x Block)"] and not rep.recompiles and not rep.fallbacks, str(rep)
    assert [g["calls_per_step"] for g in rep.graphs if g["calls_per_step"] > 1] == [3], str(rep)


def test_whole_graph_when_asked_or_when_recompute_needs_it():
    _, m = _pair(compile_blocks=False)
    m(torch.randint(0, 64, (2, 8))).backward()
    rep = graphtrain.report(m)
    assert len(rep.graphs) == 1 and not rep.blocks
    _, m = _pair(recompute="full")
    m(torch.randint(0, 64, (2, 8))).backward()
    rep = graphtrain.report(m)
    assert len(rep.graphs) == 1 and any("recompute=full" in n for n in rep.notes), str(rep)


def test_failed_block_split_runs_eagerly_with_one_warning(monkeypatch):
    import graphtrain.runtime.backend as backend

    def broken(*args, **kwargs):
        raise RuntimeError("split failed on purpose")

    monkeypatch.setattr(backend, "compile_by_blocks", broken)
    ref, m = _pair(fallback="warn")
    with pytest.warns(UserWarning, match="per-block compile"):
        _steps(ref, m, steps=1)
    assert any("split failed on purpose" in why for _, why in graphtrain.report(m).fallbacks)


class BranchingBlock(Block):
    """A block whose code Dynamo cannot trace as one graph: a branch on a tensor's value."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(self.ln(x))
        if h.sum() > 0:
            h = 2 * h
        return x + self.drop(self.out(F.gelu(h)))


def test_a_graph_break_inside_a_block_compiles_the_model_split_at_it_like_eager():
    """Dynamo traces a marked block's region whole or fails the whole call; a data-dependent branch inside a
    layer (HF Wav2Vec2's output-capturing hooks did the same) sent the model to eager for good. The blocks are
    now inlined and the model compiles in graphs split at the break, as under torch.compile."""
    torch.manual_seed(0)
    ref = Stack().train()
    ref.blocks = nn.ModuleList(BranchingBlock() for _ in range(3))
    m = graphtrain.accelerate(copy.deepcopy(ref), provider="aten", passes=ENGINE_ONLY)
    _steps(ref, m, steps=3)
    rep = graphtrain.report(m)
    assert not rep.fallbacks and not rep.blocks and len(rep.graphs) >= 2, str(rep)
    assert any("not block by block" in n and "Data-dependent" in n for n in rep.notes), rep.notes


class NormedStack(Stack):
    """A BatchNorm and a dropout in the stem, a graph break after them, then blocks that break inside."""

    def __init__(self, d: int = 32) -> None:
        super().__init__(3, d)
        self.norm, self.drop = nn.BatchNorm1d(d), nn.Dropout(0.5)
        self.blocks = nn.ModuleList(BranchingBlock(d) for _ in range(3))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.norm(self.emb(idx).flatten(0, 1)).view(*idx.shape, -1))
        torch._dynamo.graph_break()
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), idx.flatten())


def test_the_call_a_block_break_retries_updates_buffers_and_draws_dropout_once():
    """The retry above runs the call again, and the graph before the stem's break had run once already: the
    BatchNorm counted the batch twice and the dropout drew its mask twice (the second one unlike eager's). The
    call now starts again from the buffers and random state it began with."""
    torch.manual_seed(0)
    ref = NormedStack().train()
    m = graphtrain.accelerate(copy.deepcopy(ref), provider="aten", passes=ENGINE_ONLY)
    _steps(ref, m, steps=2)
    rep = graphtrain.report(m)
    assert any("not block by block" in n for n in rep.notes) and not rep.fallbacks, str(rep)
    assert int(m.norm.num_batches_tracked) == int(ref.norm.num_batches_tracked) == 2
    assert_close(m.norm.running_mean, ref.norm.running_mean, name="running mean", bitwise=True)
    assert_close(m.norm.running_var, ref.norm.running_var, name="running var", bitwise=True)


class BrokenStem(nn.Module):
    """A BatchNorm and a dropout before a graph break; after it, an input whose shape changes from call to call."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.emb, self.norm, self.drop, self.head = (
            nn.Embedding(50, d),
            nn.BatchNorm1d(d),
            nn.Dropout(0.5),
            nn.Linear(d, 50),
        )

    def forward(self, idx: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.norm(self.emb(idx).flatten(0, 1)))
        torch._dynamo.graph_break()
        return F.cross_entropy(self.head(x), idx.flatten()) + 0.0 * extra.sum()


def test_a_later_call_whose_capture_fails_after_a_graph_ran_updates_buffers_and_draws_dropout_once():
    """A later call with a new input shape captures again: here the resume function after the break, refused past
    Dynamo's recompile limit once the graph before the break had run. The eager re-run then counted the batch twice
    in the BatchNorm and drew the dropout mask twice, when only the first call went back to where it began."""
    torch.manual_seed(0)
    ref = BrokenStem().train()
    m = graphtrain.accelerate(copy.deepcopy(ref), provider="aten", passes=ENGINE_ONLY)
    idx = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(1))
    with torch._dynamo.config.patch(recompile_limit=1), warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphtrainFallbackWarning)  # the limit's report, checked below
        for step, n in enumerate([3, 5, 7]):
            losses = []
            for mod in (ref, m):
                torch.manual_seed(step)
                losses.append(mod(idx, torch.ones(n)))
                losses[-1].backward()
            assert_close(losses[1], losses[0], name=f"loss (step {step})", bitwise=True)
    assert any("recompile limit" in what for what, _ in graphtrain.report(m).fallbacks)
    assert int(m.norm.num_batches_tracked) == int(ref.norm.num_batches_tracked) == 3
    assert_close(m.norm.running_mean, ref.norm.running_mean, name="running mean", bitwise=True)
    assert_close(m.norm.running_var, ref.norm.running_var, name="running var", bitwise=True)
    assert_grads_close(m, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not HAS_HF, reason="transformers not installed")
def test_hugging_face_gpt2_blocks_match_eager_and_build_no_kv_cache():
    import transformers

    cfg = transformers.GPT2Config(
        n_layer=3,
        n_embd=32,
        n_head=2,
        vocab_size=128,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(cfg).train()
    m = transformers.GPT2LMHeadModel(cfg).train()
    m.load_state_dict(ref.state_dict())
    m = graphtrain.accelerate(m, provider="aten", fallback="error")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    outs = [mod(input_ids=ids, labels=ids) for mod in (ref, m)]
    for o in outs:
        o.loss.backward()
    assert_close(outs[1].loss, outs[0].loss, name="loss", rtol=1e-5, atol=1e-6)
    assert_grads_close(m, ref, rtol=1e-4, atol=1e-5)
    assert outs[1].past_key_values is None  # training mode: no KV cache (the eager reference builds one)
    rep = graphtrain.report(m)
    assert rep.blocks == ["transformer.h (3 x GPT2Block)"], str(rep)
    assert [g["calls_per_step"] for g in rep.graphs].count(3) == 1, str(rep)
    assert not rep.graph_breaks and not rep.fallbacks, str(rep)


class BiasBlock(nn.Module):
    """T5's way with a learned attention bias: computed once outside the blocks, added to every block's scores,
    and handed back by each block for the next."""

    def __init__(self, d: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = torch.softmax(q @ k.transpose(-1, -2) + bias, dim=-1)
        return x + self.out((att @ v).transpose(1, 2).reshape(b, s, d)), bias


class BiasStack(Stack):
    def __init__(self, layers: int = 3, d: int = 32, vocab: int = 64, seq: int = 8) -> None:
        super().__init__(layers, d, vocab)
        self.blocks = nn.ModuleList(BiasBlock(d) for _ in range(layers))
        self.rel = nn.Parameter(torch.randn(2, seq, seq))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x, bias = self.emb(idx), self.rel[None] * 0.5
        for block in self.blocks:
            x, bias = block(x, bias)
        return F.cross_entropy(self.head(x).flatten(0, 1), idx.flatten())


def _one_step_like_eager(
    ref: nn.Module, call, provider: str = "aten", loss_tol: tuple = (1e-5, 1e-6), grad_tol: tuple = (1e-4, 1e-6)
):
    """A copy of `ref` accelerated (fallback error); `call(module)` -> loss, once for each; loss and every gradient
    against eager's. Returns the accelerated module."""
    m = graphtrain.accelerate(copy.deepcopy(ref), provider=provider, fallback="error")
    losses = []
    for mod in (ref, m):
        loss = call(mod)
        loss.backward()
        losses.append(loss.detach())
    assert_close(losses[1], losses[0], name="loss", rtol=loss_tol[0], atol=loss_tol[1])
    assert_grads_close(m, ref, rtol=grad_tol[0], atol=grad_tol[1])
    return m


def test_a_learned_bias_handed_through_the_blocks_trains_like_eager():
    # Each block returns the bias it was given: the region returns a copy (a compiled region may not return its
    # input; before, capture failed). Inside a block's graph the bias is an input that needs a gradient, so
    # fuse_attention must not take it for a constant mask (checked without the check: the bias lost every block's
    # gradient share).
    torch.manual_seed(0)
    idx = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    m = _one_step_like_eager(BiasStack().train(), lambda mod: mod(idx))
    rep = graphtrain.report(m)
    assert rep.blocks == ["blocks (3 x BiasBlock)"] and not rep.fallbacks, str(rep)


def test_the_blocks_that_repeat_are_found_where_one_differs():
    from graphtrain.pipeline.block_regions import repeated_blocks

    class Biased(Block):  # T5's first block: the same class, one more weight (its relative-position bias)
        def __init__(self) -> None:
            super().__init__()
            self.bias = nn.Embedding(8, 2)

    class Model(nn.Module):
        def __init__(self, first: nn.Module, n: int, mlp: list[nn.Module]) -> None:
            super().__init__()
            self.layers = nn.ModuleList([first, *(Block() for _ in range(n))])
            self.mlp = nn.ModuleList(mlp)

    found = repeated_blocks(Model(Biased(), 3, [nn.Linear(4, 4), nn.Linear(4, 8), nn.Linear(8, 4)]))
    assert [(name, len(b)) for name, b in found] == [("layers[1, 2, 3]", 3)]  # a minority (mlp) is not a stack
    assert [(name, len(b)) for name, b in repeated_blocks(Model(Block(), 2, []))] == [("layers", 3)]


@pytest.mark.skipif(not HAS_HF, reason="transformers not installed")
def test_hugging_face_t5_repeats_its_later_blocks_like_eager():
    from graphtrain.bench.families import build_family

    ref, batch = build_family("t5", hidden=32, layers=3, vocab=101, batch=2, seq=16, dropout=False)
    rep = graphtrain.report(_one_step_like_eager(ref, lambda mod: mod(**batch).loss))
    assert rep.blocks == ["encoder.block[1, 2] (2 x T5Block)", "decoder.block[1, 2] (2 x T5Block)"], str(rep)
    assert [g["calls_per_step"] for g in rep.graphs].count(2) == 2 and not rep.fallbacks, str(rep)


def test_a_piece_gets_its_inputs_in_the_layout_it_was_compiled_for():
    from graphtrain.pipeline.blocks import _conforming

    expanded = torch.randn(1, 1, 4, 4).expand(3, 1, 4, 4)  # an expand in the trace ...
    dense = expanded.contiguous()  # ... that the piece before returned materialized
    seen = []
    fn = _conforming(lambda *a: seen.append([(x.shape, x.stride()) for x in a[:2]]) or a, [expanded, dense, 2])
    out = fn(dense, expanded, 2)
    assert seen[0] == [(expanded.shape, expanded.stride()), (dense.shape, dense.stride())]
    assert torch.equal(out[0], dense) and torch.equal(out[1], dense) and out[2] == 2
    # a transposed layout is copied into the compiled one, and the gradient goes through the copy
    x = torch.randn(4, 3, requires_grad=True)
    y = _conforming(lambda a: a, [torch.empty(4, 3).t().contiguous().t()])(x)
    assert y.stride() == (1, 4) and torch.equal(y, x)
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones(4, 3))


@pytest.mark.slow
@pytest.mark.skipif(not HAS_HF, reason="transformers not installed")
def test_hugging_face_modernbert_blocks_under_inductor_match_eager():
    # Its first layer differs (no attention norm), so its later layers repeat; under Inductor the block asserted
    # the expanded mask it was compiled for and got the dense one the graph before it returned (a fallback to
    # eager before _conforming). Inductor's compile: slow.
    from graphtrain.bench.families import build_family

    ref, batch = build_family("modernbert", hidden=64, layers=4, vocab=101, batch=2, seq=128, dropout=False)
    m = _one_step_like_eager(
        ref, lambda mod: mod(**batch).loss, provider="inductor", loss_tol=(1e-4, 1e-5), grad_tol=(1e-3, 1e-5)
    )
    assert graphtrain.report(m).blocks == ["model.layers[1, 2, 3] (3 x ModernBertEncoderLayer)"]


class RopeBlock(Block):
    """A block called the way Hugging Face calls its layers: keyword arguments, a tuple among them, a flag."""

    def forward(self, x, mask=None, *, rope=None, scale_by_rope: bool = False):  # type: ignore[override]
        cos, sin = rope
        h = self.ln(x) * cos + sin if scale_by_rope else self.ln(x)
        if mask is not None:
            h = h.masked_fill(mask, 0.0)
        return x + self.drop(self.out(F.gelu(self.fc(h))))


class RopeStack(Stack):
    def __init__(self, layers: int = 3, d: int = 32, vocab: int = 64) -> None:
        super().__init__(layers, d, vocab)
        self.blocks = nn.ModuleList(RopeBlock(d) for _ in range(layers))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        pos = torch.arange(idx.shape[1], dtype=x.dtype)[:, None] / 8
        rope, mask = (pos.cos(), pos.sin()), (idx == 0)[..., None]
        for i in range(len(self.blocks)):
            x = self.blocks[i](x, mask, rope=rope, scale_by_rope=True)
        return F.cross_entropy(self.head(x).flatten(0, 1), idx.flatten())


class _OddKeyword(nn.Module):
    """Two blocks, each called with a keyword no Python parameter could have (through **{...})."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Kw(), _Kw()])

    def forward(self, x, rope):
        for b in self.blocks:
            x = b(x, **{"rope": rope, "odd,name": True})
        return x


class _Kw(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = RopeBlock(32)

    def forward(self, x, rope=None, **extra):
        return self.block(x, None, rope=rope, scale_by_rope=extra["odd,name"])


def test_keyword_and_tuple_arguments_reach_the_block_flat(monkeypatch):
    """pipeline/blocks.py _region: a block called with keywords and a tuple gets one flat positional call, so Dynamo
    reuses its traced body without flattening the arguments through pytree; same numbers as eager, one body."""
    import importlib

    try:
        sub = importlib.import_module("torch._dynamo.variables.invoke_subgraph")
    except ImportError:  # torch 2.11: Dynamo traces every block call (no reuse, no fingerprint)
        sub = None
    structured = []
    if hasattr(sub, "build_fingerprint_with_pytree"):
        original = sub.build_fingerprint_with_pytree
        monkeypatch.setattr(
            sub, "build_fingerprint_with_pytree", lambda *a, **k: structured.append(1) or original(*a, **k)
        )
    torch.manual_seed(0)
    ref, m = RopeStack(4).train(), RopeStack(4).train()
    m.load_state_dict(ref.state_dict())
    m = graphtrain.accelerate(m, provider="aten", passes=ENGINE_ONLY, fallback="error")
    _steps(ref, m)
    rep = graphtrain.report(m)
    assert rep.blocks == ["blocks (4 x RopeBlock)"], str(rep)
    assert [g["calls_per_step"] for g in rep.graphs].count(4) == 1, str(rep)
    assert not structured, "a block call's arguments went through pytree"
    # a keyword the spec cannot carry takes the structured call, same numbers
    x = torch.randn(2, 8, 32)
    rope = (torch.ones(8, 1), torch.zeros(8, 1))
    odd = _OddKeyword().eval()
    want = odd(x, rope)
    odd = graphtrain.accelerate(odd, provider="aten", passes=ENGINE_ONLY, fallback="error")
    assert_close(odd(x, rope), want, name="odd keyword", bitwise=True)
    assert graphtrain.report(odd).blocks == ["blocks (2 x _Kw)"]
    # eager calls of the marked blocks (no Dynamo) take the plain forward
    x = torch.randn(2, 8, 32)
    rope = (torch.ones(8, 1), torch.zeros(8, 1))
    blk = m.blocks[0].eval()
    assert_close(
        blk(x, None, rope=rope, scale_by_rope=True),
        ref.blocks[0].eval()(x, None, rope=rope, scale_by_rope=True),
        name="eager block",
        bitwise=True,
    )


def test_flat_call_spec_round_trips():
    from graphtrain.pipeline.block_regions import _flatten_call, _unflatten_call

    for args, kwargs in [
        ((1, None), {"mask": "m", "rope": ("c", "s"), "flag": False}),
        ((), {}),
        (("x",), {}),
        ((("a", "b"), ()), {"empty": (), "one": ("z",)}),
    ]:
        spec, leaves = _flatten_call(args, kwargs)
        assert _unflatten_call(spec, leaves) == (list(args), kwargs), (args, kwargs, spec)


def test_dynamo_source_names_are_not_built_for_logs_that_are_off():
    """config/torch_compat.py source_names_only_when_logged: Dynamo tokenizes no source file for its debug-log names."""
    import importlib
    import logging

    fc = importlib.import_module("torch._dynamo.funcname_cache")
    sc = importlib.import_module("torch._dynamo.symbolic_convert")
    ref, m = _pair(layers=2)
    fc.clearcache()
    _steps(ref, m, steps=1)
    assert __file__ not in fc.cache and F.__file__ not in fc.cache, sorted(fc.cache)
    sc.trace_call_log.setLevel(logging.DEBUG)
    try:
        assert sc.get_funcname(__file__, RopeBlock.forward.__code__.co_firstlineno + 3) == "RopeBlock.forward"
    finally:
        sc.trace_call_log.setLevel(logging.NOTSET)
