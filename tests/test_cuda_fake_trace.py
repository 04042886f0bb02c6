"""CUDA graphs checked without a GPU: HF models traced through graphtrain's pipeline on fake tensors, with the
strides the CUDA kernels require (issue #48).

Without a GPU, torch's SDPA picks its math path even for fake CUDA tensors (it asks the device which kernels it
supports). `cuda_sdpa` stands in for the GPU's choice: a Python kernel for aten::scaled_dot_product_attention that
does what attention.cpp's CUDA branch does, the fused kernel for the inputs with compute_log_sumexp set only when
grad is enabled and an input requires grad. The aten kernels it calls are torch's own, with torch's meta
functions, so the shapes and strides in the graphs are the ones a GPU run gets.

The autodiff half runs on the meta device: the autograd engine wants a CUDA context for CUDA tensors, even fake
ones. The meta functions are the same, so is the logsumexp layout.
"""

from __future__ import annotations

import operator
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from graphtrain.config.sections import EngineConfig
from graphtrain.pipeline.functional import module_as_function
from graphtrain.pipeline.stages import autodiff, new_record, trace
from graphtrain.pipeline.state import EngineState

transformers = pytest.importorskip("transformers")

LSE_KERNELS = {
    "efficient": torch.ops.aten._scaled_dot_product_efficient_attention.default,
    "cudnn": torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}
BACKWARDS = {
    "efficient": torch.ops.aten._scaled_dot_product_efficient_attention_backward.default,
    "cudnn": torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default,
}


@pytest.fixture(params=["efficient", "cudnn"])
def cuda_sdpa(request, monkeypatch):
    """SDPA as a GPU runs it, with the `param` kernel; HF's mask code as it runs under Dynamo (where graphtrain's
    backend traces it: masks are built without reading their values, which fake tensors do not have)."""
    kernel = request.param

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if q.device.type == "cpu":
            return torch.ops.aten._scaled_dot_product_attention_math(
                q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
            )[0]
        if enable_gqa and k.shape[1] != q.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
        lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))  # sdp::should_compute_logsumexp
        if kernel == "efficient":
            return LSE_KERNELS[kernel](q, k, v, attn_mask, lse, dropout_p, is_causal, scale=scale)[0]
        return LSE_KERNELS[kernel](q, k, v, attn_mask, lse, dropout_p, is_causal, False, scale=scale)[0]

    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
        lib.impl("scaled_dot_product_attention", sdpa, "CompositeImplicitAutograd")
    import transformers.masking_utils as masking

    monkeypatch.setattr(masking, "is_tracing", lambda *a, **k: True)
    yield kernel
    lib._destroy()


def _model(name: str) -> torch.nn.Module:
    if name == "gpt2":
        cfg = transformers.GPT2Config(
            n_layer=1, n_embd=64, n_head=4, vocab_size=300, attn_implementation="sdpa", use_cache=False, attn_pdrop=0.0
        )
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(cfg)


def _fake_step(name: str, device: str, seq: int = 50):
    """The model's step (params, batch) -> (loss,) and fake inputs on `device`, params requiring grad."""
    step, tensors, kinds = module_as_function(_model(name), input_names=["input_ids", "labels"], loss=True)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        ids = torch.randint(0, 300, (2, seq), device=device)
        inputs = [
            torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device).requires_grad_(t.requires_grad)
            for t in tensors
        ] + [ids, ids]
    return (lambda *a: (step(*a),)), inputs, kinds + ["input", "input"], mode


def _check_logsumexp(kernel: str, lse: torch.Tensor) -> None:
    """A full logsumexp for 2 x 4 heads x 50 queries: one per query row ([B, H, S, 1] from cuDNN), the efficient
    kernel's rows padded to 32 (ceil(50 / 32) * 32 = 64) with the head and batch strides its backward checks."""
    assert lse.shape[:3] == (2, 4, 64 if kernel == "efficient" else 50), (lse.shape, lse.stride())
    if kernel == "efficient":
        assert lse.stride(0) % 8 == 0 and lse.stride(1) % 8 == 0, lse.stride()


def _lse_kernels(gm):
    return [n for n in gm.graph.nodes if n.target in LSE_KERNELS.values()]


@pytest.mark.skipif(
    not torch.backends.cuda.is_built(),
    reason="fake CUDA tensors need a CUDA build of torch "
    "(this one is CPU-only: HF's mask code makes CUDA constants); the meta-device test covers it",
)
@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_training_trace_for_cuda_keeps_the_logsumexp(cuda_sdpa, model):
    """The pre-autodiff IR of a CUDA graph that will be differentiated asks the fused kernel for its logsumexp,
    laid out as the backward needs it (traced under no_grad, it used to be [B, H, 0])."""
    fn, inputs, _, _ = _fake_step(model, "cuda")
    gm = trace(fn, inputs)
    nodes = _lse_kernels(gm)
    assert nodes and all(n.args[4] is True for n in nodes), [n.format_node() for n in nodes]
    for n in nodes:
        _check_logsumexp(cuda_sdpa, n.meta["val"][1])
        assert n.meta["val"][1].device.type == "cuda"


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_backward_gets_an_aligned_logsumexp(cuda_sdpa, model):
    """Through trace, autodiff and graphtrain's partitioner: each attention backward reads a full logsumexp, laid
    out as the kernel's forward returns it in eager training ("LSE is not correctly aligned (strideH)" on a GPU
    otherwise)."""
    fn, inputs, kinds, mode = _fake_step(model, "meta")
    cfg = EngineConfig(provider="aten")
    state = EngineState(cfg)
    rec = new_record("train step", model, inputs, kinds, state, frame_compile=0)
    gm = trace(fn, inputs, rec)
    assert _lse_kernels(gm)
    graphs = {}
    step = autodiff(
        gm,
        inputs,
        cfg,
        state,
        rec,
        backward_passes_at_partition=True,
        on_graphs=lambda fw, bw, _: graphs.update(fw=fw, bw=bw),
    )
    with mode:
        step(*inputs)
    backwards = [n for n in graphs["bw"].graph.nodes if n.target == BACKWARDS[cuda_sdpa]]
    assert backwards, f"no {cuda_sdpa} attention backward in the backward graph"
    at = [a.name for a in BACKWARDS[cuda_sdpa]._schema.arguments].index("logsumexp")
    for n in backwards:
        _check_logsumexp(cuda_sdpa, n.args[at].meta["val"])


def test_inference_trace_leaves_the_flag_off(cuda_sdpa):
    """No input requires grad: nothing is differentiated, so the kernel is not asked for a logsumexp."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        q = torch.empty(2, 4, 40, 16, device="meta")
    gm = trace(lambda q: (torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True),), [q])
    nodes = _lse_kernels(gm)
    assert len(nodes) == 1 and nodes[0].args[4] is False
    assert all(u.target is operator.getitem for u in nodes[0].users)
