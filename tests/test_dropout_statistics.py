"""Statistics of every fused dropout: keep rate, 1/(1-p) scaling, independence, unbiased attention.

The bounds are explicit: a rate or mean over n independent draws has standard deviation sigma (formula
at each test) and must land within Z = 5 sigma of its expectation. All draws come from seeded generators,
so every test is deterministic: a pass cannot turn into a failure between runs, and a 5-sigma bound only
fails when the implementation is wrong (for a correct one, P(|z| > 5) = 6e-7).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import graphtrain.memory.seeded  # noqa: F401  (registers graphtrain::dropout_seed, bias_dropout_add_seeded)
from graphtrain.kernels import _cpu_ext
from graphtrain.kernels._common import dropout_keep_mask

aten, gt = torch.ops.aten, torch.ops.graphtrain
Z = 5.0
N = 1 << 20  # elements per sample: sigma of a keep rate is sqrt(p (1-p) / N) <= 4.9e-4
PS = (0.1, 0.5)


# --- observing dropout draws, eager or inside a compiled graph ---------------------------------------------


@dataclass
class Draw:
    op: str
    kind: str  # "attention" (on attention probabilities, [B, H, Sq, Sk]) or "hidden" (any other activation)
    keep: torch.Tensor  # bool, shaped like the dropped tensor
    seed: int | None  # the hash seed of a graphtrain op; None for aten's Bernoulli


class DropoutDraws(TorchDispatchMode):
    """Records every dropout keep-mask drawn while active, in order: aten's Bernoulli draws (eager F.dropout,
    SDPA's math path) and graphtrain's fused ops (their masks regenerated from the seed each returns).

    An infra mode on purpose: Dynamo refuses to run compiled frames under a user dispatch mode (it runs the
    frame eagerly, "non-infra torch dispatch mode present"), and infra modes are what it ignores, while the
    mode still sees every op the compiled graph calls, with its outputs."""

    @classmethod
    def is_infra_mode(cls) -> bool:
        return True

    def __init__(self) -> None:
        super().__init__()
        self.draws: list[Draw] = []
        self.backward_seeds: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if func in (aten.bernoulli_.float, aten.bernoulli.p):  # noise tensor: 1 = keep
            keep = out != 0
            self.draws.append(Draw(name, "attention" if keep.dim() == 4 else "hidden", keep, None))
        elif func is aten.native_dropout.default:
            self.draws.append(Draw(name, "attention" if out[1].dim() == 4 else "hidden", out[1].clone(), None))
        elif func is gt.attention.default and args[6] > 0:
            q, k = args[0], args[1]
            shape = (*q.shape[:3], k.shape[2])
            keep = dropout_keep_mask(math.prod(shape), args[6], out[2]).reshape(shape)
            self.draws.append(Draw(name, "attention", keep, int(out[2])))
        elif func is gt.bias_dropout_add.default and args[3] > 0:
            keep = dropout_keep_mask(args[0].numel(), args[3], out[1]).reshape(args[0].shape)
            self.draws.append(Draw(name, "hidden", keep, int(out[1])))
        elif func is gt.bias_dropout_add_seeded.default and args[3] > 0:
            keep = dropout_keep_mask(args[0].numel(), args[3], args[4]).reshape(args[0].shape)
            self.draws.append(Draw(name, "hidden", keep, int(args[4])))
        elif func is gt.dropout_backward.default and args[1] > 0:
            self.backward_seeds.append(int(args[2]))
        elif func is gt.attention_backward.default and args[10] > 0:
            self.backward_seeds.append(int(args[7]))
        return out


# --- statistics ------------------------------------------------------------------------------------------


def _seed(g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 2**62, (1,), dtype=torch.int64, generator=g)


def _check_keep_rate(keep: torch.Tensor, p: float, what: str) -> None:
    # n independent Bernoulli(1 - p) draws: the kept fraction has mean 1 - p and sigma = sqrt(p (1 - p) / n)
    n = keep.numel()
    rate, sigma = keep.double().mean().item(), math.sqrt(p * (1 - p) / n)
    assert abs(rate - (1 - p)) <= Z * sigma, f"{what}: keep rate {rate:.5f}, expected {1 - p} +- {Z * sigma:.5f}"


def _check_uncorrelated(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    # Pearson correlation of n pairs of independent indicators: mean 0, sigma = 1 / sqrt(n) (n large)
    a, b = a.flatten().double(), b.flatten().double()
    a, b = a - a.mean(), b - b.mean()
    r = ((a * b).sum() / (a.norm() * b.norm())).item()
    bound = Z / math.sqrt(a.numel())
    assert abs(r) <= bound, f"{what}: correlation {r:.5f} of keep indicators, independent ones give |r| <= {bound:.5f}"


def _check_independent_layout(keep: torch.Tensor, what: str) -> None:
    """keep [..., rows, cols]: neighbours along a row, and the same column of adjacent rows, are independent."""
    _check_uncorrelated(keep[..., :-1], keep[..., 1:], f"{what}, adjacent elements")
    _check_uncorrelated(keep[..., :-1, :], keep[..., 1:, :], f"{what}, same column of adjacent rows")


@pytest.mark.parametrize("p", PS)
def test_reference_and_cpp_masks_keep_rate_and_independence(p):
    """The reference hash and the C++ kernels (graphtrain::bias_dropout_add's CPU path and dropout_mask) draw
    the same mask for a seed, keep 1 - p of the elements, and neighbours in a row or column are uncorrelated."""
    g = torch.Generator().manual_seed(11)
    seed = _seed(g)
    ref = dropout_keep_mask(N, p, seed).reshape(1024, 1024)
    _check_keep_rate(ref, p, "reference")
    _check_independent_layout(ref, "reference")
    ext = _cpu_ext.load()
    if ext is None:
        pytest.skip("the C++ extension does not build here (no compiler): only the reference ran")
    assert torch.equal(ext.dropout_mask([1024, 1024], p, int(seed)), ref)
    torch.manual_seed(12)
    out, op_seed = gt.bias_dropout_add(torch.ones(1024, 1024), None, None, p)
    keep = out != 0  # x = 1: a kept element is 1 / (1 - p), a dropped one 0
    assert torch.equal(keep, dropout_keep_mask(N, p, op_seed).reshape(1024, 1024)), "C++ op vs reference mask"
    _check_keep_rate(keep, p, "bias_dropout_add (C++)")
    _check_independent_layout(keep, "bias_dropout_add (C++)")


@pytest.mark.parametrize("p", PS)
def test_bias_dropout_add_kept_values_are_scaled_and_dropped_are_zero(p):
    """Kept: (x + bias) / (1 - p) [+ residual]; dropped: exactly 0 [+ residual], forward and backward."""
    from graphtrain.kernels import implementation_for

    g = torch.Generator().manual_seed(21)
    x, b, r = torch.randn(1024, 1024, generator=g), torch.randn(1024, generator=g), torch.randn(1024, 1024, generator=g)
    assert implementation_for("bias_dropout_add", "cpu", x, b, r) != "reference"
    s = torch.tensor(1.0 / (1.0 - p), dtype=torch.float32)  # the fp32 scale every implementation multiplies by
    z = x + b
    out, seed = gt.bias_dropout_add(x, b, None, p)
    keep = dropout_keep_mask(N, p, seed).reshape(x.shape)
    assert torch.equal(out, torch.where(keep, z * s, 0.0)), "without residual: exactly (x + b) * s or 0"
    out, seed = gt.bias_dropout_add(x, b, r, p)
    keep = dropout_keep_mask(N, p, seed).reshape(x.shape)
    assert torch.equal(out[~keep], r[~keep]), "a dropped element must be exactly the residual"
    # kept: z * s + r, rounded once (a fused multiply-add) or twice; each rounding is within 2^-24 of its
    # result, so |out - exact| <= 2^-24 (|z s| + |z s + r|) <= 2^-23 (|z s| + |r|) (the exact value in fp64)
    exact = z.double() * s.double() + r.double()
    err = (out.double() - exact)[keep].abs()
    assert (err <= 2.0**-23 * ((z.double() * s.double()).abs() + r.double().abs())[keep]).all(), err.max()
    gy = torch.randn(1024, 1024, generator=g)
    assert torch.equal(gt.dropout_backward(gy, p, seed), torch.where(keep, gy * s, 0.0)), "backward"


@pytest.mark.parametrize("p", PS)
def test_recompute_variant_draws_what_the_fused_op_draws(p):
    """memory.seeded's split (graphtrain::dropout_seed + bias_dropout_add_seeded) draws the same seed from the same
    generator as graphtrain::bias_dropout_add and produces the same bits, so the fused op's statistics carry over;
    two draws in a row give different seeds and uncorrelated masks."""
    g = torch.Generator().manual_seed(31)
    x, b, r = torch.randn(1024, 1024, generator=g), torch.randn(1024, generator=g), torch.randn(1024, 1024, generator=g)
    torch.manual_seed(32)
    fused, fused_seed = gt.bias_dropout_add(x, b, r, p)
    torch.manual_seed(32)
    s1, s2 = gt.dropout_seed(0), gt.dropout_seed(1)
    assert torch.equal(s1, fused_seed)
    assert torch.equal(gt.bias_dropout_add_seeded(x, b, r, p, s1), fused)
    assert int(s1) != int(s2)
    _check_uncorrelated(dropout_keep_mask(N, p, s1), dropout_keep_mask(N, p, s2), "two dropout_seed draws")


def _attention_probs_sample(p: float, causal: bool, seed: int):
    """graphtrain::attention with v = I, so its output is the dropped probabilities themselves, [4, 8, 128, 256]
    (1M elements), next to the undropped probabilities in fp64."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(4, 8, 128, 16, generator=g), torch.randn(4, 8, 256, 16, generator=g)
    v = torch.eye(256).expand(4, 8, 256, 256).contiguous()
    scale = 0.25
    s = (q.double() @ k.double().transpose(-2, -1)) * scale
    if causal:
        s = s.masked_fill(torch.ones(128, 256, dtype=torch.bool).triu(1), float("-inf"))
    probs = torch.softmax(s, -1)
    out, _, op_seed = gt.attention(q, k, v, None, scale, causal, p)
    return q, k, v, out, probs, op_seed


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("p", PS)
def test_attention_cpp_dropout_mask_rate_scale_and_independence(p, causal):
    """graphtrain::attention's CPU dropout (C++ attn_probs_fwd): the mask is the reference hash over the flat
    [B*H, Sq, Sk] index, keeps 1 - p, scales kept probabilities by 1 / (1 - p) and zeroes the rest; elements,
    rows and heads (same (i, j) in head h and h + 1) are uncorrelated."""
    from graphtrain.kernels._common import runtime_fallbacks
    from graphtrain.kernels.attention import _cpu_cpp_ok

    torch.manual_seed(41)
    q, k, v, out, probs, seed = _attention_probs_sample(p, causal, 42)
    assert _cpu_cpp_ok(q, k, v, None, p) and not runtime_fallbacks(), "the C++ path must be the one under test"
    ref = dropout_keep_mask(out.numel(), p, seed).reshape(out.shape)
    valid = probs > 0  # causal: above the diagonal the probability is 0 whether kept or not
    keep = out != 0
    assert torch.equal(keep[valid], ref[valid]), "C++ attention mask vs reference hash"
    assert not keep[~valid].any()
    _check_keep_rate(keep[valid], p, "attention (C++)")
    # fp32 scores and softmax against fp64 probabilities: measured up to 1.8e-6 relative on this machine (the
    # C++ exp differs per ISA level), so 1e-5; a wrong scale would be off by >= 11% (1/0.9 vs 1)
    torch.testing.assert_close(out[keep].double(), probs[keep] / (1 - p), rtol=1e-5, atol=0)
    _check_independent_layout(ref, "attention (C++)")
    _check_uncorrelated(ref[:, :-1], ref[:, 1:], "attention, heads h and h + 1")


def test_successive_calls_draw_independent_masks():
    """Two successive calls (two layers of one step) draw different seeds from the default generator, and
    their masks are uncorrelated, for both fused ops."""
    torch.manual_seed(51)
    x = torch.ones(1024, 1024)
    (o1, s1), (o2, s2) = gt.bias_dropout_add(x, None, None, 0.5), gt.bias_dropout_add(x, None, None, 0.5)
    assert int(s1) != int(s2)
    _check_uncorrelated(o1 != 0, o2 != 0, "bias_dropout_add, two successive calls")
    _, _, _, a1, _, t1 = _attention_probs_sample(0.5, False, 52)
    _, _, _, a2, _, t2 = _attention_probs_sample(0.5, False, 52)  # same inputs: only the seed differs
    assert int(t1) != int(t2)
    _check_uncorrelated(a1 != 0, a2 != 0, "attention, two successive calls")


def test_tensor_parallel_salt_draws_independent_attention_masks():
    """kernels._common's sharded-dropout salt (the tp rank, set by the tensor-parallel plan): salt 0 leaves
    graphtrain::attention's seed exactly what it draws without tensor parallelism; another salt consumes the
    same draw (the shared stream stays aligned across tp ranks) but gives an independent mask, which the op
    returns, so backward regenerates that mask."""
    from graphtrain.kernels._common import set_sharded_dropout_salt, sharded_dropout_salt
    from graphtrain.kernels.attention import attention_backward_reference

    assert sharded_dropout_salt() == 0
    g = torch.Generator().manual_seed(61)
    q, k, v = (torch.randn(2, 4, 64, 16, generator=g) for _ in range(3))
    p = 0.3
    torch.manual_seed(62)
    expected = torch.randint(0, 2**62, (1,), dtype=torch.int64)  # new_seed's draw
    torch.manual_seed(62)
    _, _, seed0 = gt.attention(q, k, v, None, 0.25, True, p)
    after0 = torch.get_rng_state()
    assert torch.equal(seed0, expected)
    try:
        set_sharded_dropout_salt(1)
        torch.manual_seed(62)
        qg = q.clone().requires_grad_()
        out1, lse1, seed1 = gt.attention(qg, k, v, None, 0.25, True, p)
        assert torch.equal(torch.get_rng_state(), after0), "the salted op must consume the same draw"
        dout = torch.randn_like(out1)
        out1.backward(dout)
        with pytest.raises(ValueError, match="tensor-parallel rank"):
            set_sharded_dropout_salt(-1)
    finally:
        set_sharded_dropout_salt(0)
    assert int(seed1) != int(seed0)
    m0, m1 = (dropout_keep_mask(2 * 4 * 64 * 64, p, s) for s in (seed0, seed1))
    # independent masks agree on a fraction a = (1-p)^2 + p^2 of n elements: sigma = sqrt(a (1 - a) / n)
    a, n = (1 - p) ** 2 + p**2, m0.numel()
    agree = (m0 == m1).double().mean().item()
    assert abs(agree - a) <= Z * math.sqrt(a * (1 - a) / n), agree
    dq = attention_backward_reference(dout, q, k, v, None, out1.detach(), lse1, 0.25, True, p, seed1)[0]
    torch.testing.assert_close(qg.grad, dq, rtol=1e-4, atol=1e-5)  # the returned seed is the mask's


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("case", ["causal", "masked"])
def test_attention_dropout_is_unbiased_with_eagers_spread(p, case):
    """E[attention with dropout] = attention without it: over n = 4096 independent masks (16 seeds x 256 batch
    rows of identical inputs) the mean lands within 5 sigma of the p = 0 output at every element, where
    sigma^2 = Var / n and Var = p / (1 - p) * sum_j P_ij^2 v_jd^2 (one output element is sum_j P_ij m_j v_jd
    / (1 - p) with independent Bernoulli(1 - p) m_j). The spread (sample variance summed over elements) is
    that Var's sum within 10%, and within 15% of eager's F.dropout on the softmax (both estimate the same
    variance from 4096 samples: relative standard error ~2% each, summed over correlated elements)."""
    reps, calls, H, S, D = 256, 16, 2, 16, 8
    g = torch.Generator().manual_seed(71)
    q, k, v = (torch.randn(1, H, S, D, generator=g) for _ in range(3))
    scale, causal = D**-0.5, case == "causal"
    mask = None
    if case == "masked":  # padding (last 3 keys) on top of a random additive bias; no row fully masked
        mask = torch.randn(1, H, S, S, generator=g)
        mask[..., -3:] = float("-inf")
    s = (q.double() @ k.double().transpose(-2, -1)) * scale
    s = (
        s + mask.double()
        if mask is not None
        else s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    )
    probs = torch.softmax(s, -1)
    exact = probs @ v.double()
    var = p / (1 - p) * (probs**2) @ (v.double() ** 2)  # [1, H, S, D]
    rep = [t.expand(reps, H, S, -1).contiguous() for t in (q, k, v)]
    maskr = mask.expand(reps, H, S, S).contiguous() if mask is not None else None
    out0 = gt.attention(*rep[:3], maskr, scale, causal, 0.0)[0][:1]
    torch.testing.assert_close(out0.double(), exact, rtol=1e-5, atol=1e-6)

    torch.manual_seed(72)
    # [calls * reps, H, S, D]: each call draws its own seed, each of its batch rows its own mask elements
    fused = torch.cat([gt.attention(*rep, maskr, scale, causal, p)[0] for _ in range(calls)]).double()
    n = fused.shape[0]
    z = (fused.mean(0, keepdim=True) - out0.double()) / (var / n).sqrt()
    assert z.abs().max() <= Z, f"mean of {n} fused dropout samples is {z.abs().max():.2f} sigma from p = 0"

    def eager():
        sc = (rep[0] @ rep[1].transpose(-2, -1)) * scale
        sc = (
            sc + maskr
            if maskr is not None
            else sc.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
        )
        return F.dropout(torch.softmax(sc, -1), p, training=True) @ rep[2]

    torch.manual_seed(73)
    eager_samples = torch.cat([eager() for _ in range(calls)]).double()
    z_eager = (eager_samples.mean(0, keepdim=True) - out0.double()) / (var / n).sqrt()
    assert z_eager.abs().max() <= Z  # the bound's own check: eager dropout passes it too
    spread_fused, spread_eager, spread_theory = fused.var(0).sum(), eager_samples.var(0).sum(), var.sum()
    assert abs(spread_fused / spread_theory - 1) <= 0.10, (spread_fused, spread_theory)
    assert abs(spread_fused / spread_eager - 1) <= 0.15, (spread_fused, spread_eager)


# --- inside a compiled training step -------------------------------------------------------------------


def test_compiled_step_draws_a_fresh_seed_per_op_and_step(one_thread):
    """gpt2-tiny (dropout 0.1) through graphtrain.accelerate: in each step every fused dropout (the embedding's,
    each block's residual and MLP bias_dropout_add, each block's attention) draws its own seed, no seed repeats
    within or across steps, backward regenerates exactly the forward's masks (its seeds are the forward's),
    and the masks of two layers and of two steps (torch.manual_seed set once) are uncorrelated."""
    import graphtrain
    from graphtrain.config.sections import ModelConfig
    from graphtrain.models import build_model

    torch.manual_seed(0)
    model = build_model(ModelConfig(name="gpt2-tiny", dropout=0.1))
    n_layer = model.spec.n_layer
    graphtrain.accelerate(model, provider="aten", fallback="error")
    ids = torch.randint(0, 512, (8, 64), generator=torch.Generator().manual_seed(81))
    model(ids, labels=ids).backward()  # compile outside the recording
    steps = []
    for _ in range(2):
        with DropoutDraws() as rec:
            model(ids, labels=ids).backward()
        steps.append(rec)
    seeds = []
    for rec in steps:
        ops = [d.op for d in rec.draws]
        assert ops.count("graphtrain.attention.default") == n_layer, ops
        assert ops.count("graphtrain.bias_dropout_add.default") == 1 + 2 * n_layer, ops
        assert len(ops) == 1 + 3 * n_layer, f"a dropout outside the fused ops: {ops}"
        step_seeds = [d.seed for d in rec.draws]
        assert sorted(rec.backward_seeds) == sorted(step_seeds)
        seeds += step_seeds
    assert len(set(seeds)) == len(seeds), f"a seed repeated: {seeds}"
    att = [[d.keep for d in rec.draws if d.kind == "attention"] for rec in steps]
    _check_uncorrelated(att[0][0], att[0][1], "compiled step, attention of layers 0 and 1")
    _check_uncorrelated(
        torch.cat([m.flatten() for m in att[0]]),
        torch.cat([m.flatten() for m in att[1]]),
        "compiled steps 1 and 2, attention",
    )
    hidden = [torch.cat([d.keep.flatten() for d in rec.draws if d.kind == "hidden"]) for rec in steps]
    _check_uncorrelated(hidden[0], hidden[1], "compiled steps 1 and 2, hidden dropouts")


# --- Triton --------------------------------------------------------------------------------------------------
# Triton's masks are shown bitwise equal to the reference's for the same seed, on samples that cross the kernels'
# block boundaries (bias_dropout_add: 1024-element blocks, a partial last one, rows of 107 for the bias; attention:
# 16 x 16 tiles under the interpreter, partial in both dims, several heads), so the reference's statistics above
# carry over. Under TRITON_INTERPRET=1 in a subprocess: the flag must be set before triton is imported.

_TRITON_SCRIPT = textwrap.dedent("""
    import os
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from graphtrain.kernels import KERNELS
    from graphtrain.kernels._common import dropout_keep_mask
    from graphtrain.kernels.attention import attention_reference
    from graphtrain.kernels.bias_dropout_add import bias_dropout_add_reference, dropout_backward_reference
    gt = torch.ops.graphtrain
    g = torch.Generator().manual_seed(91)
    for p in (0.1, 0.5):
        x, b, r = torch.randn(49, 107, generator=g), torch.randn(107, generator=g), torch.randn(49, 107, generator=g)
        assert x.numel() % 1024 and x.numel() > 5 * 1024
        assert KERNELS["bias_dropout_add"].implementation_for("cuda", x, b, r) == "triton"
        for _ in range(3):
            out, seed = gt.bias_dropout_add(x, b, r, p)
            keep = dropout_keep_mask(x.numel(), p, seed).reshape(x.shape)
            assert torch.equal(out, bias_dropout_add_reference(x, b, r, p, seed)), "triton bda vs reference"
            assert torch.equal(out[~keep], r[~keep])
            gy = torch.randn(x.shape, generator=g)
            assert torch.equal(gt.dropout_backward(gy, p, seed), dropout_backward_reference(gy, p, seed))
        for causal in (False, True):
            q, k = torch.randn(2, 3, 37, 8, generator=g), torch.randn(2, 3, 53, 8, generator=g)
            v = torch.eye(53).expand(2, 3, 53, 53).contiguous()  # out = the dropped probabilities
            assert KERNELS["attention"].implementation_for("cuda", q, k, v, None) == "triton flash"
            out, lse, seed = gt.attention(q, k, v, None, 0.3, causal, p)
            probs = attention_reference(q, k, v, None, 0.3, causal, 0.0, seed)[0]
            valid = probs > 0
            keep = dropout_keep_mask(out.numel(), p, seed).reshape(out.shape)
            assert torch.equal((out != 0)[valid], keep[valid]), "triton attention mask vs reference"
            assert not (out != 0)[~valid].any()
            torch.testing.assert_close(out[keep & valid], probs[keep & valid] / (1 - p), rtol=1e-5, atol=1e-7)
    print("ok triton dropout masks", flush=True)
""")


def test_triton_masks_equal_the_reference():
    pytest.importorskip("triton")
    r = subprocess.run(
        [sys.executable, "-c", _TRITON_SCRIPT],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert r.returncode == 0 and "ok triton dropout masks" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
