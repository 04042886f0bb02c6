"""graphtrain.report(model) opens with a one-screen summary (graphs and providers, breaks, fallbacks and why,
predicted and measured memory) and names the model's tensors as the model does, never as Dynamo's placeholders."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphtrain
from graphtrain.tools.report import user_name

pytestmark = pytest.mark.usefixtures("tiny_env")
MANGLED = re.compile(r"[lL]_self_|L\['self'\]")


class TiedLM(nn.Module):
    """Returns its logits with the loss, so the engine detaches the returned head and notes which weight it is."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(64, 16), ln_f=nn.LayerNorm(16)))
        self.lm_head = nn.Linear(16, 64, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.lm_head(self.transformer.ln_f(self.transformer.wte(x)))
        return logits, F.cross_entropy(logits.flatten(0, 1), y.flatten())


@pytest.fixture(scope="module")
def trained():
    torch.manual_seed(0)
    model = TiedLM()
    accelerated = graphtrain.accelerate(model, provider="aten")
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randint(0, 64, (2, 8))
    for _ in range(2):
        _, loss = accelerated(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return accelerated, opt


def test_the_report_opens_with_a_one_screen_summary(trained):
    accelerated, opt = trained
    rep = graphtrain.report(accelerated, optimizer=opt)
    lines = str(rep).splitlines()
    head = lines[: lines.index("details:")]
    assert head[0].startswith("graphtrain report") and head[1].startswith("summary: 1 graph(s) captured")
    assert len(head) <= 20, "\n".join(head)
    text = "\n".join(head)
    assert re.search(r"providers: aten \(fp32\) for graph0", text), text
    assert "graph breaks: 0" in text and "fallbacks: 0 (engine), 0 (fused ops at run time): none" in text
    step = rep.step_peak["peak"]
    assert (
        f"predicted step peak {step / 2**10:.1f} KiB" in text or f"predicted step peak {step / 2**20:.2f} MiB" in text
    ), text
    assert rep.measured_peak["bytes"] > 0 and "measured peak RSS of the process" in text
    assert "time to first step" in text


def test_no_mangled_names_anywhere(trained):
    accelerated, opt = trained
    rep = graphtrain.report(accelerated, optimizer=opt)
    text = str(rep)
    assert not MANGLED.search(text), MANGLED.search(text)
    assert not MANGLED.search(repr(rep.to_dict()))
    assert any("returned logits of transformer.wte.weight" in n for n in rep.notes), rep.notes


def test_user_name_reads_dynamo_placeholders():
    assert user_name("l_self_modules_transformer_modules_wte_parameters_weight_") == "transformer.wte.weight"
    assert (
        user_name("l_self_modules_model_modules_layers_modules_0_modules_self_attn_modules_q_proj_parameters_weight_")
        == "model.layers.0.self_attn.q_proj.weight"
    )
    assert user_name("l_self_modules_lm_head_parameters_weight_") == "lm_head.weight"
    assert user_name("l_self_buffers_rope_cache_") == "rope_cache"
    assert user_name("l_x_") == "l_x_" and user_name("primals_1") == "primals_1"


def test_fallbacks_are_in_the_summary_with_why():
    """A real fallback (Dynamo's recompile limit reached: new shapes run eagerly) is counted and explained first."""
    import torch._dynamo

    torch._dynamo.reset()  # the limit counts every compile of the engine's call frame in this process
    # torch's config patch, not pytest's monkeypatch: monkeypatch's undo deleted the key from Dynamo's config
    # module, and every later test in the process failed on "recompile_limit does not exist"
    with torch._dynamo.config.patch(recompile_limit=1):
        accelerated = graphtrain.accelerate(nn.Linear(4, 4), provider="aten")
        for n in (2, 3, 5):
            accelerated(torch.randn(n, 4)).sum().backward()
    rep = graphtrain.report(accelerated)
    head = str(rep).split("\ndetails:")[0].splitlines()
    assert len(rep.fallbacks) >= 1
    at = next(i for i, line in enumerate(head) if line.startswith("  fallbacks: "))
    assert head[at].startswith(f"  fallbacks: {len(rep.fallbacks)} (engine)") and head[at].endswith("why:"), head
    assert head[at + 1].startswith("    - recompile limit of Linear: "), head
    torch._dynamo.reset()
