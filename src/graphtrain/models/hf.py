"""`model.hf: PATH`: a Hugging Face transformer (Llama, Qwen2, Mistral, GPT-2, BERT, RoBERTa...) in the trainer.

    model:
      hf: ./my-llama            # a local folder with config.json (weights too when it has model.safetensors),
                                # or a config.json file: random init from the config
      objective: clm            # clm (causal LM) | mlm (masked LM); inferred from the config where unambiguous

Nothing is downloaded: the config and weights are read with ``local_files_only=True``, and only safetensors
weights are loaded (a folder with only ``pytorch_model.bin`` is refused: pickle files run code when read).

`HFLanguageModel` wraps the built ``AutoModelForCausalLM`` / ``AutoModelForMaskedLM`` so the trainer sees what it
sees of graphtrain's own models: ``forward(input_ids, labels)`` returns the mean cross-entropy on labels that are
already aligned with the inputs (graphtrain's batches shift causal labels once, so the HF model's own shifting
loss is not used), ``.family`` names the data objective ("gpt2": causal, "bert": masked), ``.spec`` the sizes the
FLOP count, checkpoints and the memory planner read, and ``generate`` samples like `GPT2.generate`. The HF
module itself is ``.hf``: export writes it with ``save_pretrained``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from graphtrain.models.gpt2 import GPT2
from graphtrain.models.spec import ModelSpec

# model_type -> objective, for configs whose `architectures` does not say (random-init configs written by hand)
_CAUSAL_TYPES = {
    "gpt2",
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "phi",
    "phi3",
    "gpt_neox",
    "gptj",
    "opt",
    "falcon",
    "olmo",
    "olmo2",
    "stablelm",
    "starcoder2",
    "bloom",
    "codegen",
    "smollm3",
}
_MASKED_TYPES = {
    "bert",
    "roberta",
    "xlm-roberta",
    "distilbert",
    "electra",
    "deberta",
    "deberta-v2",
    "albert",
    "camembert",
    "mpnet",
    "modernbert",
}
# config attributes that hold a dropout probability, per architecture family (model.dropout sets all present)
_DROPOUT_KEYS = (
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "attention_dropout",
    "hidden_dropout",
    "dropout",
    "embedding_dropout",
    "summary_first_dropout",
)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ValueError("model.hf needs the transformers package: pip install 'graphtrain[hf]'") from None
    return transformers


def hf_folder(path: str) -> tuple[Path, Path]:
    """(the folder, its config.json) of `model.hf`; a clear error when neither is there."""
    p = Path(path).expanduser()
    if p.is_file():
        if p.suffix != ".json":
            raise ValueError(
                f"model.hf {path!r} is a file but not a config.json: point model.hf at a Hugging Face "
                f"model folder (with config.json) or at a config.json"
            )
        return p.parent, p
    if not p.is_dir():
        raise ValueError(
            f"model.hf {path!r} does not exist: point it at a local Hugging Face model folder or a "
            f"config.json (nothing is downloaded, so hub names such as 'gpt2' are not accepted)"
        )
    if not (p / "config.json").is_file():
        raise ValueError(
            f"model.hf {path!r} is a folder with no config.json: point it at a Hugging Face model folder "
            f"(save one with model.save_pretrained(folder) or config.save_pretrained(folder))"
        )
    return p, p / "config.json"


def load_hf_config(path: str) -> Any:
    transformers = _transformers()
    folder, config_file = hf_folder(path)
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise ValueError(
            f"model.hf: {str(config_file)!r} is not readable JSON ({e}): fix or re-save the config"
        ) from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ValueError(
            f"model.hf: {str(config_file)!r} has no model_type: it is not a transformers config "
            f"(write it with config.save_pretrained(folder))"
        )
    try:
        return transformers.AutoConfig.for_model(**raw)
    except (ValueError, KeyError) as e:
        raise ValueError(
            f"model.hf: transformers {transformers.__version__} cannot build model_type "
            f"{raw['model_type']!r} ({e}): upgrade transformers or use a supported architecture"
        ) from None


def infer_objective(hf_config: Any, objective: str | None) -> str:
    """clm or mlm: `model.objective` when set, else from the config's architectures, else its model_type."""
    if objective is not None:
        return objective
    for arch in getattr(hf_config, "architectures", None) or []:
        if arch.endswith(("ForCausalLM", "LMHeadModel")):
            return "clm"
        if arch.endswith("ForMaskedLM"):
            return "mlm"
    if hf_config.model_type in _CAUSAL_TYPES:
        return "clm"
    if hf_config.model_type in _MASKED_TYPES:
        return "mlm"
    raise ValueError(
        f"model.hf: cannot tell whether model_type {hf_config.model_type!r} is a causal or a masked "
        f"language model: set model.objective=clm or model.objective=mlm"
    )


def spec_of(hf_config: Any, objective: str) -> ModelSpec:
    """The sizes graphtrain reads (FLOPs, memory plan, checkpoint compatibility) from a transformers config."""

    def first(*names: str, default: Any = None) -> Any:
        for n in names:
            v = getattr(hf_config, n, None)
            if v is not None:
                return v
        return default

    d_model = first("hidden_size", "n_embd", "d_model", "dim")
    n_head = first("num_attention_heads", "n_head")
    n_layer = first("num_hidden_layers", "n_layer")
    if not all(isinstance(v, int) for v in (d_model, n_head, n_layer)):
        raise ValueError(
            f"model.hf: model_type {hf_config.model_type!r} does not name hidden_size, "
            f"num_attention_heads and num_hidden_layers in its config (an attention-free model such as Mamba): the "
            f"Trainer cannot size it; train it with graphtrain.accelerate in your own loop (docs/guides/own-loop.md)"
        )
    return ModelSpec(
        family="gpt2" if objective == "clm" else "bert",
        n_layer=n_layer,
        n_head=n_head,
        d_model=d_model,
        d_ff=first("intermediate_size", "n_inner", "ffn_dim", default=4 * d_model),
        vocab_size=hf_config.vocab_size,
        max_seq_len=first("max_position_embeddings", "n_positions", default=2048),
        dropout=float(first(*_DROPOUT_KEYS, default=0.0)),
        layer_norm_eps=float(first("layer_norm_eps", "rms_norm_eps", "layer_norm_epsilon", default=1e-5)),
        hf_type=hf_config.model_type,
    )


def configure(cfg: Any, vocab_size: int | None = None) -> tuple[Any, str]:
    """(the transformers config with the ModelConfig's overrides applied, the objective)."""
    hf_config = load_hf_config(cfg.hf)  # a fresh object per call: the overrides below stay local
    objective = infer_objective(hf_config, cfg.objective)
    if cfg.dropout is not None:
        for key in _DROPOUT_KEYS:
            if isinstance(getattr(hf_config, key, None), float):
                setattr(hf_config, key, cfg.dropout)
    if cfg.max_seq_len is not None:
        for key in ("max_position_embeddings", "n_positions"):
            if hasattr(hf_config, key):
                setattr(hf_config, key, cfg.max_seq_len)
    if cfg.vocab_size is not None:
        hf_config.vocab_size = cfg.vocab_size
    if vocab_size is not None and vocab_size > hf_config.vocab_size:
        raise ValueError(
            f"the tokenizer has {vocab_size} tokens but model.hf {cfg.hf!r} has a vocabulary of "
            f"{hf_config.vocab_size}: its ids would not fit the embedding. Set data.vocab_size <= "
            f"{hf_config.vocab_size} (the trained tokenizer), or data.tokenizer to the model's own "
            f"tokenizer, or model.vocab_size={vocab_size} (random init only)"
        )
    hf_config.use_cache = False  # training: no key/value cache
    return hf_config, objective


def _weights(folder: Path) -> Path | None:
    for name in ("model.safetensors", "model.safetensors.index.json"):
        if (folder / name).is_file():
            return folder / name
    return None


def build_hf_model(cfg: Any, vocab_size: int | None = None) -> HFLanguageModel:
    """The model `cfg.hf` names, freshly initialized (the global seed) or with the folder's safetensors weights."""
    transformers = _transformers()
    hf_config, objective = configure(cfg, vocab_size)
    folder, _ = hf_folder(cfg.hf)
    hf_config._attn_implementation = "sdpa" if cfg.attention == "sdpa" else "eager"
    auto = transformers.AutoModelForCausalLM if objective == "clm" else transformers.AutoModelForMaskedLM
    pretrained = Path(cfg.hf).expanduser().is_dir()  # a folder: its weights; a config.json: random init
    weights = _weights(folder) if pretrained else None
    if (
        pretrained
        and weights is None
        and any((folder / n).is_file() for n in ("pytorch_model.bin", "pytorch_model.bin.index.json"))
    ):
        raise ValueError(
            f"model.hf {cfg.hf!r} has only pytorch_model.bin weights; graphtrain loads safetensors only "
            f"(pickle files run code when read): convert them (model.save_pretrained(folder, "
            f"safe_serialization=True)), or point model.hf at its config.json for a random init"
        )
    if weights is not None and cfg.vocab_size is not None and cfg.vocab_size != load_hf_config(cfg.hf).vocab_size:
        raise ValueError(
            f"model.vocab_size={cfg.vocab_size} cannot change the vocabulary of the pretrained weights "
            f"in {cfg.hf!r}: drop model.vocab_size, or point model.hf at its config.json for a random init"
        )
    try:
        if weights is not None:
            model = auto.from_pretrained(str(folder), config=hf_config, local_files_only=True, use_safetensors=True)
        else:
            model = auto.from_config(hf_config)
    except ValueError as e:
        raise ValueError(
            f"model.hf {cfg.hf!r}: transformers cannot build a {objective} model "
            f"({'AutoModelForCausalLM' if objective == 'clm' else 'AutoModelForMaskedLM'}) of model_type "
            f"{hf_config.model_type!r}: {str(e).splitlines()[0]}. Set model.objective to the other "
            f"objective, or use a causal-LM or masked-LM architecture"
        ) from None
    return HFLanguageModel(model, objective, spec_of(hf_config, objective))


def _accepts(module: nn.Module, name: str) -> bool:
    import inspect

    return name in inspect.signature(module.forward).parameters


class HFLanguageModel(nn.Module):
    """A transformers language model seen as graphtrain's reference models are (see the module docstring)."""

    def __init__(self, hf: nn.Module, objective: str, spec: ModelSpec) -> None:
        super().__init__()
        if objective not in ("clm", "mlm"):
            raise ValueError(f"objective must be clm or mlm, got {objective!r}")
        self.hf, self.objective, self.spec = hf, objective, spec
        self.family = spec.family
        self.max_seq_len = spec.max_seq_len
        self.attention = "sdpa" if getattr(hf.config, "_attn_implementation", "") == "sdpa" else "explicit"
        self._takes_token_types = _accepts(hf, "token_type_ids")

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [B, T, V] without labels; with labels [B, T] (aligned with the inputs, -100 ignored), the mean
        cross-entropy."""
        kwargs: dict[str, Any] = {}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        if token_type_ids is not None and self._takes_token_types:
            kwargs["token_type_ids"] = token_type_ids
        logits = self.hf(input_ids=input_ids, use_cache=False, **kwargs).logits
        if labels is None:
            return logits
        if labels.shape != input_ids.shape:
            raise ValueError(
                f"labels must have the shape of input_ids {tuple(input_ids.shape)}, got {tuple(labels.shape)}"
            )
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)

    generate = GPT2.generate  # the same sampler (it reads only max_seq_len and the logits of forward)

    def tie_weights(self) -> None:
        self.hf.tie_weights()
