"""Every C++ kernel states its contract once (kernels/contract.py): the Python gate refuses what the contract
refuses, the C++ entry point raises on it before touching memory, and both say the same thing. Grouped-query
attention is a named case: forward and backward against SDPA's enable_gqa and the reference, on each path."""

from __future__ import annotations

import importlib
import re

import pytest
import torch
import torch.nn.functional as F

from graphtrain.kernels import _cpu_ext
from graphtrain.kernels.contract import CONTRACTS, Contract, Layout, Rule
from graphtrain.kernels.registry import OPS
from graphtrain.testing import assert_close

A = importlib.import_module("graphtrain.kernels.attention")  # the module (graphtrain.kernels.attention is the function)


@pytest.fixture(scope="module")
def mod():
    m = _cpu_ext.load()
    if m is None:
        pytest.skip(f"no C++ compiler: {_cpu_ext.build_error()}")
    return m


def _body(name: str) -> str:
    """The C++ source of entry point `name`, from its signature's opening brace."""
    m = re.search(rf"^\S[^\n]*\b{name}\([^;{{]*\)\s*\{{", _cpu_ext.source(), re.M)
    assert m, name
    return _cpu_ext.source()[m.end() :]


def test_every_cpp_entry_point_an_op_calls_checks_its_contract_first():
    """Each function an op's descriptor names (except the capability probe) has a contract, and the first statement of
    its body is that contract's check: a caller that skipped the gate gets an error, not undefined behaviour."""
    claimed = {c for d in OPS.values() for c in d.cpp} - {"attn_heads_available"}
    assert claimed <= set(CONTRACTS), claimed - set(CONTRACTS)
    for name in claimed:
        first = _body(name).strip().split("\n", 1)[0].strip()
        assert first == CONTRACTS[name].call(), (name, first)
        assert CONTRACTS[name].cpp() in _cpu_ext.source()


def test_the_extension_source_is_every_csrc_file_once_with_the_generated_checks():
    """The hand-written C++ lives in kernels/csrc/; the loader joins it into one source, each header once and the
    generated gt_contracts.h (every contract's check) where it is first included, leaving no local include behind."""
    src = _cpu_ext.source()
    assert not re.search(r'^#include "', src, re.M)
    assert "#pragma once" not in src
    files = sorted(p for p in _cpu_ext.CSRC.iterdir() if p.suffix in (".cpp", ".h"))
    assert {p.name for p in files} >= set(_cpu_ext._UNITS)
    for p in files:
        for part in re.split(r'^(?:#include "[^"]+"|#pragma once)[^\n]*\n', p.read_text(), flags=re.M):
            assert part.strip() == "" or src.count(part) == 1, (p.name, part[:200])
    for c in CONTRACTS.values():
        assert src.count(c.cpp()) == 1, c.name
    fake = {
        "a.cpp": '#include "h.h"\n#include "gen.h"  // generated\nA\n',
        "b.cpp": '#include "h.h"\nB\n',
        "h.h": '#include <vector>\n#include "gen.h"\nH\n',
    }
    assert (
        _cpu_ext._assemble(("a.cpp", "b.cpp"), fake.__getitem__, {"gen.h": "G\n"}) == "#include <vector>\nG\nH\nA\nB\n"
    )


def test_the_extension_is_named_after_its_source(tmp_path, monkeypatch):
    """Editing any file under csrc/ gives the extension a new name (and build folder): a stale build is never loaded,
    and there is no version number to forget."""
    before = _cpu_ext.module_name()
    copy = tmp_path / "csrc"
    copy.mkdir()
    for p in _cpu_ext.CSRC.iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    (copy / "common.h").write_text((copy / "common.h").read_text() + "// an edit\n")
    monkeypatch.setattr(_cpu_ext, "CSRC", copy)
    _cpu_ext.source.cache_clear()
    try:
        after = _cpu_ext.module_name()
    finally:
        monkeypatch.undo()
        _cpu_ext.source.cache_clear()
    assert after != before and after.startswith(_cpu_ext.MODULE_PREFIX + "_")
    assert _cpu_ext.module_name() == before


def test_rules_outside_the_shared_syntax_are_refused():
    with pytest.raises(ValueError, match="shared Python/C"):
        Contract("bad", ("x",), rules=(Rule("!cpu(x)", "x"),))
    with pytest.raises(ValueError, match="shared Python/C"):
        Contract("bad", ("x",), rules=(Rule("x.size(0) / 2 == 1", "x"),))


def _gqa(B, H, Hkv, S, D, layout="contiguous"):
    """q, k, v [B, H|Hkv, S, D] in one of the layouts models give them."""
    torch.manual_seed(0)
    if layout == "fused":  # sliced from one q/k/v projection, [B, S, heads, D] viewed as [B, heads, S, D]
        qkv = torch.randn(B, S, (H + 2 * Hkv) * D)
        q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
        return [t.reshape(B, S, -1, D).transpose(1, 2) for t in (q, k, v)]
    q = torch.randn(B, H, S, D)
    if layout == "expanded":  # k, v one head broadcast with stride 0 over the key/value heads
        k, v = torch.randn(B, 1, S, D).expand(B, Hkv, S, D), torch.randn(B, 1, S, D).expand(B, Hkv, S, D)
        return [q, k, v]
    return [q, torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)]


def _run(q, k, v, causal, p, impl):
    """out, dq, dk, dv of the op and of the reference, with the op's fast paths limited to `impl`."""
    from graphtrain.kernels._common import force_reference

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]  # detach keeps the layout (strides) of each
    others = {"c++ heads", "cpu flash", "c++"} - {impl}
    with _only(impl, others):
        out, _, seed = torch.ops.graphtrain.attention(*leaves, None, q.shape[-1] ** -0.5, causal, p)
        do = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
        grads = torch.autograd.grad(out, leaves, do)
    with force_reference():
        ref, _ = A.attention_reference(*leaves, None, q.shape[-1] ** -0.5, causal, p, seed)
        ref_grads = torch.autograd.grad(ref, leaves, do)
    return (out, *grads), (ref, *ref_grads)


class _only:
    """Switch off every CPU path but `impl` (their gates' answers), so one path at a time meets GQA shapes."""

    def __init__(self, impl, others):
        self.others = others
        self.saved = {}

    def __enter__(self):
        names = {"c++ heads": "_cpu_heads_ok", "cpu flash": "_cpu_flash_ok", "c++": "_cpu_cpp_ok"}
        for impl in self.others:
            fn = names[impl]
            self.saved[fn] = getattr(A, fn)
            setattr(A, fn, lambda *a, **k: False)

    def __exit__(self, *exc):
        for fn, f in self.saved.items():
            setattr(A, fn, f)


@pytest.mark.parametrize("impl,p", [("c++ heads", 0.0), ("c++ heads", 0.1), ("cpu flash", 0.0), ("c++", 0.1)])
@pytest.mark.parametrize("layout", ["contiguous", "fused", "expanded"])
@pytest.mark.parametrize("heads", [(4, 2), (6, 1), (2, 4)])
def test_grouped_query_attention_on_every_cpu_path(mod, impl, p, layout, heads):
    """Query heads > key/value heads (GQA, MQA) match the reference forward and backward on each path; the reverse
    (more key/value heads than query heads) is refused with one line, on every path."""
    H, Hkv = heads
    q, k, v = _gqa(2, H, Hkv, 37, 16, layout)
    if H % Hkv:
        with pytest.raises(ValueError, match="divides q's"):
            A.attention(q, k, v, is_causal=True)
        assert not A._cpu_heads_ok(q, k, v, None, p, True)
        return
    if impl == "c++ heads":
        assert A._cpu_heads_ok(q, k, v, None, p, True)
    got, want = _run(q, k, v, True, p, impl)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert_close(a, b, name=f"{impl} {name}", rtol=1e-5, atol=1e-5)
    if p == 0:
        sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        assert_close(got[0], sdpa, name="out vs SDPA", rtol=1e-5, atol=1e-5)


def _refusals():
    """(what, q, k, v): layouts the head-by-head kernel must refuse."""
    q = torch.randn(2, 4, 8, 16)
    return [
        ("3 kv heads for 4", q, torch.randn(2, 3, 8, 16), torch.randn(2, 3, 8, 16)),
        ("k's head size", q, torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 16)),
        ("batch", q, torch.randn(1, 4, 8, 16), torch.randn(1, 4, 8, 16)),
        ("no keys", q, torch.randn(2, 4, 0, 16), torch.randn(2, 4, 0, 16)),
        ("v's keys", q, torch.randn(2, 4, 8, 16), torch.randn(2, 4, 9, 16)),
        ("fp64", q.double(), torch.randn(2, 4, 8, 16).double(), torch.randn(2, 4, 8, 16).double()),
        ("rows overlap", q, torch.randn(2, 4, 1, 16).expand(2, 4, 8, 16), torch.randn(2, 4, 8, 16)),
        ("3-D", q[0], torch.randn(4, 8, 16), torch.randn(4, 8, 16)),
    ]


@pytest.mark.parametrize("what,q,k,v", _refusals(), ids=[r[0] for r in _refusals()])
def test_the_heads_kernel_refuses_what_its_contract_refuses_in_python_and_in_cpp(mod, what, q, k, v):
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype) if q.dim() == 4 else torch.empty(0)
    why = A.HEADS_FWD.violation(q, k, v, out, A.HEADS_QB)
    assert why is not None, what
    with pytest.raises(RuntimeError) as e:
        mod.attn_heads_fwd(q, k, v, out, 0.25, True, 0.0, 1, A.HEADS_QB)
    assert why in str(e.value)
    if q.dim() == 4 and what != "rows overlap":  # the gate normalizes overlapping rows (a copy), so it may take those
        assert not A._cpu_heads_ok(q, k, v, None, 0.1, True)


def test_the_heads_kernel_copies_an_expanded_sequence_before_blas_reads_it(mod):
    """k broadcast over its keys (stride 0 in S) is no BLAS matrix: the op copies it, never passes lda = 0."""
    q, v = torch.randn(2, 4, 8, 16), torch.randn(2, 4, 8, 16)
    k = torch.randn(2, 4, 1, 16).expand(2, 4, 8, 16)
    assert A._cpu_heads_ok(q, k, v, None, 0.1, True)
    got, want = _run(q, k, v, True, 0.1, "c++ heads")
    for a, b in zip(got, want):
        assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "name,args",
    [
        ("bias_dropout_add_fwd", (torch.randn(4, 0), torch.empty(0), torch.empty(0), 0.1, 1)),
        ("bias_dropout_add_fwd", (torch.randn(4, 8), torch.randn(7), torch.empty(0), 0.1, 1)),
        ("bias_dropout_add_fwd", (torch.randn(4, 8), torch.empty(0), torch.randn(8), 0.1, 1)),
        ("gelu_tanh_fwd", (torch.randn(3, 0), torch.empty(0))),
        ("gelu_tanh_bwd", (torch.randn(3, 4), torch.randn(4, 3), torch.empty(0))),
        ("attn_probs_fwd", (torch.randn(4, 8, 0), torch.empty(0), 2, 0.5, False, 0.1, 1)),
        ("attn_probs_fwd", (torch.randn(3, 8, 8), torch.empty(0), 2, 0.5, False, 0.1, 1)),
        ("attn_probs_fwd", (torch.randn(4, 8, 8), torch.randn(2, 2, 8, 7), 2, 0.5, False, 0.1, 1)),
        ("ce_fwd_bwd_inplace", (torch.randn(4, 8), torch.zeros(3, dtype=torch.long), -100, 1.0, torch.empty(4))),
        # columns apart (a transposed buffer), rows overlapping (a row stride under the width)
        ("ce_fwd_bwd_inplace", (torch.randn(8, 4).t(), torch.zeros(4, dtype=torch.long), -100, 1.0, torch.empty(4))),
        (
            "ce_fwd_bwd_inplace",
            (torch.randn(40).as_strided((4, 8), (4, 1)), torch.zeros(4, dtype=torch.long), -100, 1.0, torch.empty(4)),
        ),
        (
            "ce_fwd_bwd_rows",
            (
                torch.randn(4, 8),
                torch.randn(5, 7),
                torch.zeros(4, dtype=torch.long),
                torch.zeros(4, dtype=torch.long),
                -100,
                1.0,
                torch.empty(4),
            ),
        ),
        ("onednn_matmul", (torch.randn(4, 8), torch.randn(7, 3), torch.empty(4, 3), 0.0)),
    ],
)
def test_each_cpp_entry_point_raises_on_a_broken_contract_before_it_runs(mod, name, args):
    """Shapes that would have read out of bounds (a bias, mask or source row of the wrong size) or divided by zero (an
    empty last dim): one error naming the contract's rule, never a crash."""
    with pytest.raises(RuntimeError, match=rf"^{name}: "):
        try:
            getattr(mod, name)(*args)
        except RuntimeError as e:  # TORCH_CHECK's message, without its C++ source location
            raise RuntimeError(str(e).splitlines()[0]) from None


def test_layouts_and_tensors_read_the_same_through_a_contract():
    t = torch.randn(3, 5, 7).transpose(1, 2)
    c = Contract("probe", ("x",), rules=(Rule("x.is_contiguous()", "contiguous"),))
    assert c.violation(t) == "probe: contiguous" == c.violation(Layout.of(t))
    assert c.holds(t.contiguous()) and c.holds(Layout.contiguous(t.shape, t.dtype))
    assert c.holds(torch.empty(3, 1, 4)[:, :, :2].expand(3, 1, 2).contiguous())


def test_a_contract_remembers_its_verdicts_by_everything_a_rule_reads():
    """The gates run at every call of a fused op, so a contract keeps its verdicts (Contract._verdicts); a verdict
    is reused only for arguments alike in shape, strides, dtype, device and integers."""
    c = Contract(
        "probe_memo",
        ("x",),
        rules=(
            Rule("x.is_contiguous()", "contiguous"),
            Rule("f32(x)", "fp32"),
            Rule("cpu(x)", "on the CPU"),
            Rule("x.size(0) <= n", "rows"),
        ),
        ints=("n",),
    )
    t = torch.randn(3, 4)
    assert c.holds(t, 3) and c.holds(t, 3)  # the second from memory
    assert c.violation(t.t(), 4) == "probe_memo: contiguous"  # same shape class, other strides
    assert c.violation(torch.randn(4, 3).t().contiguous(), 3) is None  # t's layout again: its verdict
    assert c.violation(t.bfloat16(), 3) == "probe_memo: fp32"
    assert c.violation(Layout.of(t)._replace(device="cuda"), 3) == "probe_memo: on the CPU"
    assert c.violation(t, 2) == "probe_memo: rows"  # same tensor, another integer
    assert c.holds(t, 3) and len(c._verdicts) == 5


def test_triton_paths_refuse_tensors_whose_offsets_pass_int32(monkeypatch):
    """The Triton kernels' offsets are int32 (row * stride + column): a tensor with 2^32 elements (an expanded view,
    no memory behind it) is not given to them; a small one is."""
    from graphtrain.kernels import _common

    if not _common.HAS_TRITON:
        pytest.skip("triton is not installed")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _common.triton_ok(torch.empty(4, 4))
    big = torch.empty(2**16, 1).expand(2**16, 2**16)
    assert not _common.triton_ok(big)
    assert not _common.triton_ok(torch.empty(4, 4), torch.empty(1).expand(2**31))
