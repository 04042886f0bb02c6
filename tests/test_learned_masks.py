"""An SDPA mask that needs a gradient (a learned bias: Swin's relative position table) is captured and trained,
checked forward and backward against eager PyTorch (bitwise on the aten provider: the same math implementation)."""

from __future__ import annotations

import copy

import pytest
import torch

import graphtrain
from graphtrain.testing import assert_close, assert_grads_close


class WindowAttention(torch.nn.Module):
    """Swin's pattern: a bias gathered from a learned table, added to a fixed window mask, handed to SDPA."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)
        self.table = torch.nn.Parameter(torch.randn(31, 4) * 0.1)
        self.register_buffer("idx", (torch.arange(16 * 16) * 7) % 31, persistent=False)
        self.dropout = dropout

    def forward(self, x: torch.Tensor, window_mask: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 4, 8).permute(2, 0, 3, 1, 4)
        bias = self.table[self.idx].view(16, 16, -1).permute(2, 0, 1).contiguous().unsqueeze(0)
        mask = bias + window_mask.unsqueeze(1).unsqueeze(0).expand(b // 2, -1, -1, -1, -1).reshape(-1, 1, n, n)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout)
        return o.transpose(1, 2).reshape(b, n, 32)


def _inputs():
    torch.manual_seed(1)
    wm = torch.zeros(2, 16, 16)
    wm[1, :, 8:] = -100.0
    return torch.randn(4, 16, 32), wm


@pytest.mark.parametrize("provider", ["aten", "auto"])
def test_a_learned_mask_trains_under_the_graph(provider):
    torch.manual_seed(0)
    ref = WindowAttention()
    m = graphtrain.accelerate(copy.deepcopy(ref), provider=provider, fallback="error")
    x, wm = _inputs()
    for mod in (ref, m):
        mod(x, wm).square().mean().backward()
    bitwise = provider == "aten"
    assert_close(m(x, wm), ref(x, wm), bitwise=bitwise)
    assert_grads_close(m, ref, bitwise=bitwise)
    assert dict(m.named_parameters())["table"].grad.abs().sum() > 0  # the bias table learns
    rep = graphtrain.report(m)
    assert not rep.fallbacks and not rep.eager_only
    assert any("needs a gradient" in line for line in rep.notes or []), rep.notes
    (rec,) = [p for p in rep.passes if p["name"] == "route_learned_masks_to_math"]
    assert rec["stage"] == "dynamo" and rec["rewrites"] == 1, rec


def test_switched_off_the_mask_reaches_flash_attention_again():
    """engine.passes: {route_learned_masks_to_math: false}: the SDPA call keeps flash attention, whose backward
    refuses the mask; the provider fails and the module runs eagerly (still eager's numbers), and the report says
    why."""
    torch.manual_seed(0)
    ref = WindowAttention()
    m = graphtrain.accelerate(
        copy.deepcopy(ref), provider="aten", fallback="silent", passes={"route_learned_masks_to_math": False}
    )
    x, wm = _inputs()
    for mod in (ref, m):
        mod(x, wm).square().mean().backward()
    assert_grads_close(m, ref)
    rep = graphtrain.report(m)
    assert rep.fallbacks, "the rewrite happened"
    assert not any("needs a gradient" in line for line in rep.notes or []), rep.notes
    assert not [p for p in rep.passes if p["name"] == "route_learned_masks_to_math"], rep.passes
    assert "switched off (engine.passes): route_learned_masks_to_math" in str(rep)


def test_hf_swin_trains_without_falling_back():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.SwinConfig(
        image_size=32,
        patch_size=4,
        embed_dim=16,
        depths=[2],
        num_heads=[2],
        window_size=4,
        num_labels=5,
        attn_implementation="sdpa",
    )
    ref = transformers.SwinForImageClassification(cfg).train()
    m = graphtrain.accelerate(copy.deepcopy(ref), provider="aten", fallback="error")
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 3])
    for mod in (ref, m):
        mod(pixel_values=x, labels=y).loss.backward()
    assert_grads_close(m, ref, rtol=1e-4, atol=1e-6)
    assert not graphtrain.report(m).fallbacks
