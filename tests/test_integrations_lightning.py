"""#16: PyTorch Lightning (optional): a LightningModule whose network is accelerated by graphtrain trains
unchanged, with the per-step losses of the plain LightningModule (fp32 tolerance table: rtol 1e-4)."""

from __future__ import annotations

import pytest
import torch

lightning = pytest.importorskip("lightning")

import graphtrain  # noqa: E402
from graphtrain.config.sections import ModelConfig  # noqa: E402
from graphtrain.models import build_model  # noqa: E402


class _LitLM(lightning.LightningModule):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _fit(accelerate: bool, callbacks=()) -> _LitLM:
    torch.manual_seed(0)
    model = build_model(ModelConfig(name="gpt2-tiny", dropout=0.0), vocab_size=512)
    if accelerate:
        model = graphtrain.accelerate(model, provider="aten")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (8, 17), generator=g)
    data = [{"input_ids": ids[i : i + 2, :-1], "labels": ids[i : i + 2, 1:]} for i in range(0, 8, 2)]
    lit = _LitLM(model)
    trainer = lightning.Trainer(
        max_steps=4,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
    )
    trainer.fit(lit, torch.utils.data.DataLoader(data, batch_size=None))
    return lit


def test_lightning_trains_the_accelerated_network_like_eager(one_thread):
    from graphtrain.integrations.lightning import GraphtrainCallback

    callback = GraphtrainCallback()
    fast, plain = _fit(True, [callback]), _fit(False)
    assert len(fast.losses) == 4 and fast.losses == pytest.approx(plain.losses, rel=1e-4), (fast.losses, plain.losses)
    assert callback.summary["graphtrain_graphs"] >= 1 and callback.summary["graphtrain_fallbacks"] == 0
    assert hasattr(fast.model, "_graphtrain") and type(fast.model).__name__ == "GPT2"
