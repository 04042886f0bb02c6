"""Model shapes by name, and `build_model`, which turns a `ModelConfig` into a module.

Vocabulary size precedence in `build_model`: `model.vocab_size` (an explicit override), then the
tokenizer's size passed by the caller, then the preset's. The seed presets `gpt2-medium` and
`bert-large` match the published parameter counts (see tests/test_models.py).
"""

from __future__ import annotations

import dataclasses
import difflib

from torch import nn

from graphtrain.config.sections import ModelConfig
from graphtrain.models.bert import BERT
from graphtrain.models.gpt2 import GPT2
from graphtrain.models.hf import build_hf_model, configure, spec_of
from graphtrain.models.spec import ModelSpec


def _gpt2(n_layer: int, n_head: int, d_model: int, vocab_size: int, max_seq_len: int) -> ModelSpec:
    return ModelSpec(
        family="gpt2",
        n_layer=n_layer,
        n_head=n_head,
        d_model=d_model,
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        layer_norm_eps=1e-5,
    )


def _bert(n_layer: int, n_head: int, d_model: int, vocab_size: int, max_seq_len: int) -> ModelSpec:
    return ModelSpec(
        family="bert",
        n_layer=n_layer,
        n_head=n_head,
        d_model=d_model,
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        layer_norm_eps=1e-12,
    )


PRESETS: dict[str, ModelSpec] = {
    # tiny: unit tests
    "gpt2-tiny": _gpt2(n_layer=2, n_head=2, d_model=64, vocab_size=512, max_seq_len=64),
    "bert-tiny": _bert(n_layer=2, n_head=2, d_model=64, vocab_size=512, max_seq_len=64),
    # mini: the default job, trains in minutes on a laptop CPU
    "gpt2-mini": _gpt2(n_layer=4, n_head=4, d_model=256, vocab_size=8192, max_seq_len=256),
    "bert-mini": _bert(n_layer=4, n_head=4, d_model=256, vocab_size=8192, max_seq_len=256),
    # small: a single GPU
    "gpt2-small": _gpt2(n_layer=6, n_head=8, d_model=512, vocab_size=16384, max_seq_len=512),
    "bert-small": _bert(n_layer=6, n_head=8, d_model=512, vocab_size=16384, max_seq_len=512),
    # published shapes
    "gpt2": _gpt2(n_layer=12, n_head=12, d_model=768, vocab_size=50257, max_seq_len=1024),
    "bert-base": _bert(n_layer=12, n_head=12, d_model=768, vocab_size=30522, max_seq_len=512),
    "gpt2-medium": _gpt2(n_layer=24, n_head=16, d_model=1024, vocab_size=50257, max_seq_len=1024),
    "bert-large": _bert(n_layer=24, n_head=16, d_model=1024, vocab_size=30522, max_seq_len=512),
}


def get_spec(name: str) -> ModelSpec:
    """A copy of the preset `name`; an unknown name raises ValueError with a suggestion."""
    if not isinstance(name, str):
        raise TypeError(f"model.name must be a preset name (a string), got {type(name).__name__}")
    if name not in PRESETS:
        close = difflib.get_close_matches(name, list(PRESETS), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"unknown model preset {name!r}: {hint}set model.name to one of {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name])


def resolve_spec(cfg: ModelConfig, vocab_size: int | None = None) -> ModelSpec:
    """The preset named by `cfg` with the config's overrides applied."""
    if not isinstance(cfg, ModelConfig):
        raise TypeError(
            f"build_model expects a graphtrain.config.sections.ModelConfig (e.g. config.model), "
            f"got {type(cfg).__name__}"
        )
    if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1):
        raise ValueError(f"vocab_size must be a positive integer (the tokenizer's size), got {vocab_size!r}")
    if cfg.hf is not None:
        return spec_of(*configure(cfg, vocab_size))
    spec = get_spec(cfg.name)
    changes: dict[str, object] = {}
    if cfg.vocab_size is not None and vocab_size is not None and cfg.vocab_size < vocab_size:
        # ids past the embedding's rows ended the first step in an IndexError traceback
        raise ValueError(
            f"model.vocab_size={cfg.vocab_size} is smaller than the tokenizer's vocabulary ({vocab_size} "
            f"ids): set model.vocab_size to at least {vocab_size}, or leave it unset (null: the "
            f"tokenizer's size)"
        )
    if cfg.vocab_size is not None:
        changes["vocab_size"] = cfg.vocab_size
    elif vocab_size is not None:
        changes["vocab_size"] = vocab_size
    if cfg.dropout is not None:
        changes["dropout"] = cfg.dropout
    if cfg.max_seq_len is not None:
        changes["max_seq_len"] = cfg.max_seq_len
    try:
        return dataclasses.replace(spec, **changes)
    except ValueError as e:
        raise ValueError(f"model {cfg.name!r} with overrides {changes}: {e}") from None


def build_model(cfg: ModelConfig, vocab_size: int | None = None) -> nn.Module:
    """Build the reference model `cfg.name` (a GPT2 or BERT), freshly initialized; with `cfg.hf`, that Hugging
    Face model (models/hf.py).

    `vocab_size` is the tokenizer's size; `cfg.vocab_size` wins over it, and the preset's size is
    used when neither is given. Construct under ``torch.device("meta")`` to count parameters free.
    """
    if isinstance(cfg, ModelConfig) and cfg.hf is not None:
        return build_hf_model(cfg, vocab_size)
    spec = resolve_spec(cfg, vocab_size)
    if spec.family == "gpt2":
        return GPT2(spec, attention=cfg.attention)
    return BERT(spec, attention=cfg.attention)


def count_parameters(model: nn.Module) -> int:
    """Number of distinct parameter elements (tied weights counted once); works on meta tensors."""
    return sum(p.numel() for p in model.parameters())
