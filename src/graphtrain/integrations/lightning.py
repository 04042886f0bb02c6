"""graphtrain in PyTorch Lightning: the LightningModule's network trains through the engine, Lightning unchanged.

The recipe::

    class LitLM(lightning.LightningModule):
        def __init__(self, model):
            super().__init__()
            self.model = graphtrain.accelerate(model)      # in place: class, parameters, state_dict keys kept
        def training_step(self, batch, batch_idx):
            return self.model(**batch)                     # the loss
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)

    lightning.Trainer(max_steps=..., callbacks=[GraphtrainCallback()]).fit(LitLM(model), loader)

Accelerate the network, not the LightningModule: Lightning's hooks (logging, ``self.log``, the trainer
reference) are Python-side bookkeeping that belongs outside the graph. Lightning's own loop, optimizer steps,
gradient accumulation, clipping and checkpoints then run as they do for the plain module. Do not also pass the
module to ``torch.compile``. ``GraphtrainCallback`` logs what the engine did (graphs, graph breaks, fallbacks) as
metrics when fitting ends. PyTorch Lightning is optional (``pip install lightning``); this module imports it
lazily.
"""

from __future__ import annotations

from typing import Any

from graphtrain.tools.report import report

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the recipe needs no graphtrain code; only the callback needs Lightning
    Callback = object  # type: ignore[misc,assignment]


def engine_summary(module: Any) -> dict[str, float]:
    """{graphtrain_graphs, graphtrain_graph_breaks, graphtrain_fallbacks} over the accelerated submodules."""
    totals = {"graphtrain_graphs": 0.0, "graphtrain_graph_breaks": 0.0, "graphtrain_fallbacks": 0.0}
    for sub in module.modules():
        if hasattr(sub, "_graphtrain"):
            rep = report(sub)
            totals["graphtrain_graphs"] += len(rep.graphs)
            totals["graphtrain_graph_breaks"] += len(rep.graph_breaks)
            totals["graphtrain_fallbacks"] += len(rep.fallbacks)
    return totals


class GraphtrainCallback(Callback):  # type: ignore[misc]
    """Logs the engine's summary to the Trainer's loggers when fitting ends (``summary`` keeps it too)."""

    def __init__(self) -> None:
        if Callback is object:
            raise ImportError("GraphtrainCallback needs PyTorch Lightning: pip install lightning")
        super().__init__()
        self.summary: dict[str, float] = {}

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self.summary = engine_summary(pl_module)
        for logger in trainer.loggers:
            logger.log_metrics(self.summary, step=trainer.global_step)
