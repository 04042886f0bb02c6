"""How the engine calls a Hugging Face model: the adjustments a call needs so that Dynamo captures it once and well.

    adapter = call_adapter(module, engine_config)   # None for a module that needs none (not a Hugging Face model)
    adapter.before_call(kwargs)                     # every call, compiled or eager
    adapter.eager_call(kwargs)                      # why this call runs eagerly (generation), or None
    adapter.before_compiled_call(kwargs, notes)     # a call about to run the compiled graphs

frontend/accelerate.py's call wrapper runs these hooks and knows nothing of Hugging Face; each adjustment gives the
call what eager Hugging Face would compute from it (the loss and the gradients do not change) and says so in `notes`
(the report's) where the caller could not tell otherwise. ``trace_through_log_once`` is the process-wide part.
transformers is never imported here: a module is a Hugging Face model only if transformers is loaded already.
"""

from __future__ import annotations

import inspect
import logging
import sys
from typing import Any

import torch


def trace_through_log_once() -> None:
    """Let Dynamo trace through Hugging Face's ``logger.warning_once`` / ``info_once`` (transformers adds them to
    ``logging.Logger``) instead of breaking the graph there. A break makes Dynamo restart the frame's analysis:
    HF GPT-2's forward warns about its loss type on every call, which cost a second full trace of the model
    (measured 7.4 s of 13.8 s tracing, 12 layers, 2-core AVX2 EPYC). The price: such a message, printed once per
    process in eager, is not printed from compiled code."""
    for name in ("warning_once", "info_once"):
        fn = getattr(logging.Logger, name, None)
        if fn is not None:
            torch._dynamo.config.ignore_logging_functions.add(fn)


def _is_hf_model(module: torch.nn.Module) -> bool:
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(module, getattr(transformers, "PreTrainedModel", ()))


def _forward_takes(module: torch.nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def builds_kv_cache(module: torch.nn.Module) -> bool:
    """Whether `module` is a Hugging Face model that fills a KV cache on every forward unless told not to
    (``config.use_cache`` true and a ``use_cache`` argument). A training step never reads that cache: it holds
    every layer's keys and values until the step ends, and its per-layer update is a side effect that stops
    Dynamo from reusing a traced block (pipeline/blocks.py). In training mode graphtrain passes
    ``use_cache=False`` unless the caller passes ``use_cache`` itself; eval and generation are untouched."""
    if getattr(getattr(module, "config", None), "use_cache", None) is not True:
        return False
    return _forward_takes(module, "use_cache")


def takes_kv_cache(module: torch.nn.Module) -> bool:
    """Whether `module` is a Hugging Face model whose forward takes a key/value cache (``past_key_values``): what
    ``generate`` passes at its prefill (an empty cache) and at every decoding step (the cache so far, one token
    longer each time)."""
    return _is_hf_model(module) and _forward_takes(module, "past_key_values")


def takes_attention_mask(module: torch.nn.Module) -> bool:
    """Whether `module` is a Hugging Face model with an ``attention_mask`` argument. A 2-D mask of all ones means
    what no mask means (every token attends): Hugging Face's eager SDPA path sees that (it reads the mask) and
    passes ``is_causal=True``; under a tracer it cannot, and builds the causal mask from the padding mask, an
    input, which engine.static_masks then cannot read either. So graphtrain passes such a mask as None, unless
    the call also passes ``position_ids`` (without a mask Hugging Face would look for packed sequences in them)."""
    return _is_hf_model(module) and _forward_takes(module, "attention_mask")


def reads_problem_type(module: torch.nn.Module) -> bool:
    """Whether `module` is a Hugging Face model whose forward decides ``config.problem_type`` at its first call with
    labels (the *ForSequenceClassification, *ForImageClassification, ... heads: inline in about 85 models'
    forwards, or through transformers' ``ForSequenceClassificationLoss``)."""
    if not _is_hf_model(module) or not hasattr(getattr(module, "config", None), "problem_type"):
        return False
    try:
        if "problem_type" in inspect.getsource(type(module).forward):
            return True
    except (OSError, TypeError):
        pass
    loss_utils = sys.modules.get("transformers.loss.loss_utils")
    if loss_utils is None:
        return False
    # the loss_function property, read without it (it logs a warning for a model without a loss type)
    loss = getattr(module, "_loss_function", None) or getattr(loss_utils, "LOSS_MAPPING", {}).get(
        getattr(module, "loss_type", None)
    )
    return loss is not None and loss is getattr(loss_utils, "ForSequenceClassificationLoss", None)


class CallAdapter:
    """The adjustments one Hugging Face model's calls get (see the module's docstring); built by `call_adapter`."""

    def __init__(self, module: torch.nn.Module, config: Any) -> None:
        self.module = module
        self.no_cache_in_training = builds_kv_cache(module)
        self.full_mask_as_none = takes_attention_mask(module) and config.static_masks and not config.dynamic
        self.settles_problem_type = reads_problem_type(module)
        self.generates = takes_kv_cache(module)

    def needed(self) -> bool:
        return self.no_cache_in_training or self.full_mask_as_none or self.settles_problem_type or self.generates

    def eager_call(self, kwargs: dict) -> str | None:
        """Why this call runs the model eagerly, or None. A call given a key/value cache is a step of generation
        (takes_kv_cache): each decoding step has a new cache length, so compiling them cost a compile per token
        (HF GPT-2, 2 layers, 20 new tokens: 7.1 s against eager's 0.02 s, 20 graphs) until Dynamo's recompile
        limit, which then also stopped the training calls of any new shape from compiling. graphtrain compiles
        training steps; generation runs as eager Hugging Face runs it, and the compiled graphs stay for training.

        ``generate(use_cache=False)`` passes no cache: each step is the whole sequence so far, one token longer, so
        it compiled a graph per token the same way. Its calls are the gradient-free ones that pass both
        ``use_cache=False`` and ``return_dict=True`` (transformers 5's generate passes both; a training or
        evaluation call rarely passes both, and if it does it only runs eagerly)."""
        if not self.generates:
            return None
        if kwargs.get("past_key_values") is not None:
            return (
                "calls given a key/value cache (past_key_values: Hugging Face's generate) ran the model eagerly: "
                "each decoding step has a new shape, and the compiled graphs are kept for training"
            )
        if kwargs.get("use_cache") is False and kwargs.get("return_dict") is True and not torch.is_grad_enabled():
            return (
                "gradient-free calls with use_cache=False and return_dict=True (Hugging Face's generate without a "
                "cache) ran the model eagerly: each decoding step is one token longer, and the compiled graphs are "
                "kept for training"
            )
        return None

    def before_call(self, kwargs: dict) -> None:
        """Every call: ``use_cache=False`` in training mode unless the caller passed ``use_cache`` (builds_kv_cache)."""
        if self.no_cache_in_training and self.module.training and "use_cache" not in kwargs:
            kwargs["use_cache"] = False

    def before_compiled_call(self, kwargs: dict, notes: list[str]) -> None:
        """A call that runs the compiled graphs: an all-ones 2-D attention mask as None (takes_attention_mask) and
        ``config.problem_type`` settled before the first call with labels (reads_problem_type)."""
        if self.full_mask_as_none:
            self._drop_full_mask(kwargs, notes)
        if self.settles_problem_type:
            self._settle_problem_type(kwargs, notes)

    @staticmethod
    def _drop_full_mask(kwargs: dict, notes: list[str]) -> None:
        mask = kwargs.get("attention_mask")
        if (
            isinstance(mask, torch.Tensor)
            and mask.dim() == 2
            and kwargs.get("position_ids") is None
            and bool(mask.all())
        ):
            kwargs["attention_mask"] = None
            note = (
                "attention_mask of all ones passed as None, as Hugging Face's eager SDPA path treats it (its "
                "causal mask then reaches SDPA as is_causal; engine.static_masks)"
            )
            if note not in notes:
                notes.append(note)

    def _settle_problem_type(self, kwargs: dict, notes: list[str]) -> None:
        """Set ``config.problem_type`` before the call, as the model's forward would set it inside the call. Dynamo
        guards on the attribute, so leaving it to the forward made the second call compile the model again
        (Hugging Face ViT and Swin classifiers: a second trace and compile at the second step). Hugging Face's
        rule, the same in every model that has it: one label is regression; more, with integer labels, single-label
        classification; otherwise multi-label."""
        config, labels = self.module.config, kwargs.get("labels")
        if config.problem_type is not None or not isinstance(labels, torch.Tensor):
            return
        if config.num_labels == 1:
            config.problem_type = "regression"
        elif config.num_labels > 1 and labels.dtype in (torch.long, torch.int):
            config.problem_type = "single_label_classification"
        else:
            config.problem_type = "multi_label_classification"
        note = (
            f"config.problem_type set to {config.problem_type!r} before the first call, by Hugging Face's rule "
            f"(its forward sets it in the first call, which would make the second call compile again)"
        )
        if note not in notes:
            notes.append(note)


def call_adapter(module: torch.nn.Module, config: Any) -> CallAdapter | None:
    """The adjustments calls to `module` need under the engine config `config` (static_masks, dynamic), or None
    when they need none."""
    adapter = CallAdapter(module, config)
    return adapter if adapter.needed() else None
