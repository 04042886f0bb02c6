"""graphtrain in ``transformers.Trainer``: the model trains through the engine, the Trainer unchanged.

The recipe::

    model = AutoModelForCausalLM.from_config(cfg)            # or from_pretrained(local folder)
    model = graphtrain.integrations.hf.accelerate_for_trainer(model)
    trainer = Trainer(model=model, args=TrainingArguments(..., torch_compile=False),
                      callbacks=[GraphtrainCallback()], ...)
    trainer.train()

``graphtrain.accelerate`` compiles the module in place (its class, parameters, ``state_dict`` keys and
``save_pretrained`` are unchanged), so the Trainer's own loop, optimizer, scheduler, gradient accumulation,
clipping and checkpointing run as they do for the plain model. Leave ``TrainingArguments.torch_compile`` off: the
module is compiled already (``torch_compile_backend="graphtrain"`` with ``torch_compile=True`` also works, through
the ``torch_dynamo_backends`` entry point, but without graphtrain's per-model settings or report).
``GraphtrainCallback`` adds what the engine did (graphs, graph breaks, fallbacks) to the Trainer's log at the
end of training and warns at the start when gradient checkpointing is on (the engine's ``recompute`` does that
job inside the graph; HF's checkpointing breaks the graph at every layer).
"""
from __future__ import annotations

import warnings
from typing import Any

import torch

try:
    from transformers import TrainerCallback
except ImportError:  # the callback needs transformers; accelerate_for_trainer does not
    TrainerCallback = object  # type: ignore[misc,assignment]


def accelerate_for_trainer(model: torch.nn.Module, config: Any = None, **overrides: Any) -> torch.nn.Module:
    """`graphtrain.accelerate(model, config, **overrides)` for a model a Hugging Face Trainer will train."""
    from graphtrain.engine.api import accelerate
    if getattr(model, "is_gradient_checkpointing", False):
        warnings.warn("graphtrain: the model has Hugging Face gradient checkpointing on, which breaks the graph at "
                      "every layer; call model.gradient_checkpointing_disable() and use engine.recompute instead",
                      stacklevel=2)
    return accelerate(model, config, **overrides)


class GraphtrainCallback(TrainerCallback):  # type: ignore[misc]
    """Logs the engine's summary (graphs, breaks, fallbacks) when training ends."""

    def on_train_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if model is None or not hasattr(model, "_graphtrain"):
            return
        from graphtrain.engine.report import report
        rep = report(model)
        summary = {"graphtrain_graphs": len(rep.graphs), "graphtrain_graph_breaks": len(rep.graph_breaks),
                   "graphtrain_fallbacks": len(rep.fallbacks), "graphtrain_eager_only": rep.eager_only}
        state.log_history.append({**summary, "step": state.global_step})
