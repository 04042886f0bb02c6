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
``GraphtrainCallback`` writes what the engine did (graphs, graph breaks, fallbacks, whether it ran eagerly) through
the Trainer's own logging (``Trainer.log``) after the last step, so every ``report_to`` logger (TensorBoard, W&B,
MLflow, ...) records it beside the loss, and ``state.log_history`` holds it; it warns at the start when gradient
checkpointing is on (the engine's ``recompute`` does that job inside the graph; HF's checkpointing breaks the graph
at every layer). A callback is not handed its Trainer, so ``GraphtrainCallback()`` finds the Trainer whose
training loop called it (the caller's frames); ``GraphtrainCallback(trainer)`` names it instead.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch

from graphtrain.frontend.accelerate import accelerate
from graphtrain.tools.report import report

try:
    from transformers import TrainerCallback
except ImportError:  # the callback needs transformers; accelerate_for_trainer does not
    TrainerCallback = object  # type: ignore[misc,assignment]


_CHECKPOINTING = (
    "graphtrain: the model has Hugging Face activation (gradient) checkpointing on, which breaks the "
    "graph at every layer; call model.activation_checkpointing_disable() (transformers < 5: "
    "gradient_checkpointing_disable()) and use engine.recompute instead"
)


def accelerate_for_trainer(model: torch.nn.Module, config: Any = None, **overrides: Any) -> torch.nn.Module:
    """`graphtrain.accelerate(model, config, **overrides)` for a model a Hugging Face Trainer will train."""
    if _checkpointing(model):
        warnings.warn(_CHECKPOINTING, stacklevel=2)
    return accelerate(model, config, **overrides)


class GraphtrainCallback(TrainerCallback):  # type: ignore[misc]
    """Logs the engine's summary (graphs, breaks, fallbacks) through `Trainer.log` after the last step."""

    def __init__(self, trainer: Any = None) -> None:
        self._given = self.trainer = trainer
        self._logged = False

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._logged = False
        self.trainer = self._given or _calling_trainer()  # found anew for each train(): the callback may be reused
        if _checkpointing(model) and hasattr(model, "_graphtrain"):
            warnings.warn(_CHECKPOINTING, stacklevel=2)

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        # the last step (DefaultFlowCallback, earlier in the list, has set should_training_stop): the loggers are
        # still open here; at on_train_end the report_to callbacks before this one have closed theirs
        if control.should_training_stop or state.global_step >= state.max_steps:
            self._log(state, control, model)

    def on_train_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._log(state, control, model)  # a loop that ended without a last step (interrupted by another callback)

    def _log(self, state: Any, control: Any, model: Any) -> None:
        if self._logged or model is None or not hasattr(model, "_graphtrain"):
            return
        self._logged = True
        summary = engine_summary(model)
        if self.trainer is not None:
            # state.log_history and every callback's on_log (the report_to loggers); the handler's on_log clears
            # should_log, which would drop the Trainer's own log of this step (its loss): kept as it was
            pending = control.should_log
            self.trainer.log(summary)
            control.should_log = self.trainer.control.should_log = pending
        else:  # no Trainer found (callbacks driven by hand): the history only
            warnings.warn(
                "GraphtrainCallback: no transformers.Trainer called it, so the engine summary goes to "
                "state.log_history only; pass the trainer: GraphtrainCallback(trainer)",
                stacklevel=2,
            )
            state.log_history.append({**summary, "step": state.global_step})


def _checkpointing(model: Any) -> bool:
    """Hugging Face activation (gradient) checkpointing is on (transformers 5 renamed the property)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def engine_summary(model: Any) -> dict[str, float]:
    """The engine's report of an accelerated model as numbers a logger takes."""
    rep = report(model)
    return {
        "graphtrain_graphs": len(rep.graphs),
        "graphtrain_graph_breaks": len(rep.graph_breaks),
        "graphtrain_fallbacks": len(rep.fallbacks),
        "graphtrain_eager_only": int(bool(rep.eager_only)),
    }


def _calling_trainer() -> Any:
    """The transformers.Trainer whose method is on the call stack (the training loop calling the callbacks)."""
    try:
        from transformers import Trainer
    except ImportError:
        return None
    frame = inspect.currentframe()
    try:
        while frame is not None:
            owner = frame.f_locals.get("self")
            if isinstance(owner, Trainer):
                return owner
            frame = frame.f_back
    finally:
        del frame
    return None
