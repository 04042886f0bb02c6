"""A trained model as a Hugging Face folder: the transformers model, the run's tokenizer, and the special-token ids
that tie them together.

Used by ``graphtrain export --format hf`` (graphtrain/export) and by ``train.export_hf`` at the end of a run
(trainer), which is why it lives in the models layer. `to_transformers` maps graphtrain's GPT-2 to
``GPT2LMHeadModel`` (exact GELU; HF's Conv1D keeps [in, out], the transposed Linear) and its post-LayerNorm BERT
to ``BertForMaskedLM`` (the fused qkv split); a ``model.hf`` model is its transformers model already.

The special-token ids written into ``config.json`` and ``generation_config.json`` come from the exported
tokenizer, never from the input config: a ``model.hf`` run starts from a config whose ids (Llama's bos 1, eos 2)
belong to another tokenizer, and with graphtrain's own BPE (eos ``<|endoftext|>`` = 0, pad ``[PAD]`` = 1)
``generate()`` would never stop. For a causal model bos is the eos token: graphtrain's training stream puts eos
between documents and nothing else before them, so eos is what every document the model saw followed (GPT-2's
convention, ``<|endoftext|>`` for both). A masked model gets pad only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


def to_transformers(model: torch.nn.Module) -> Any:
    """The transformers model holding `model`'s weights (a model.hf model: the model itself)."""
    if getattr(model.spec, "hf_type", None):
        hf = model.hf
        hf.config.use_cache = True  # back to inference defaults
        return hf
    return _to_gpt2(model) if model.spec.family == "gpt2" else _to_bert(model)


def special_token_ids(tokenizer: Any, causal: bool) -> dict[str, int | None]:
    """{bos,eos,pad}_token_id of the exported tokenizer (see the module docstring for bos)."""
    eos = getattr(tokenizer, "eos_id", None)
    if not causal:
        return {"pad_token_id": getattr(tokenizer, "pad_id", None)}
    return {"bos_token_id": eos, "eos_token_id": eos, "pad_token_id": getattr(tokenizer, "pad_id", None)}


def set_special_token_ids(hf: Any, ids: dict[str, int | None]) -> None:
    """Write `ids` into the model's config and, for a model that generates, its generation config."""
    for key, value in ids.items():
        setattr(hf.config, key, value)
        if getattr(hf, "generation_config", None) is not None:
            setattr(hf.generation_config, key, value)


def write_tokenizer(tokenizer: Any, folder: Path, max_len: int, causal: bool) -> str:
    """tokenizer.json plus a tokenizer_config.json naming the special tokens for PreTrainedTokenizerFast."""
    tokenizer.save(Path(folder) / "tokenizer.json")
    settings: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len}
    specials = tokenizer.specials
    if causal and specials.get("eos") is not None:
        settings["bos_token"] = specials["eos"]
    for role in ("eos", "pad", "mask", "cls", "sep"):
        if specials.get(role) is not None:
            settings[f"{role}_token"] = specials[role]
    (Path(folder) / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
    return str(Path(folder) / "tokenizer.json")


def write_hf_folder(
    model: torch.nn.Module, tokenizer: Any, folder: str | Path, sample: torch.Tensor, ref: torch.Tensor
) -> dict[str, Any]:
    """Save `model` (eval mode) as a Hugging Face folder with `tokenizer` (None: weights and config only, the
    special ids left as the model's config has them), load it back with AutoModelForCausalLM/ForMaskedLM and
    compare its logits on `sample` with `ref` (the model's own). Returns {class, max_abs_diff, special_tokens}."""
    import transformers

    folder = Path(folder)
    causal = model.spec.family == "gpt2"
    hf = to_transformers(model)
    ids = special_token_ids(tokenizer, causal) if tokenizer is not None else {}
    set_special_token_ids(hf, ids)
    hf.save_pretrained(str(folder), safe_serialization=True)
    if tokenizer is not None:
        write_tokenizer(tokenizer, folder, model.spec.max_seq_len, causal)
    auto = transformers.AutoModelForCausalLM if causal else transformers.AutoModelForMaskedLM
    loaded = auto.from_pretrained(str(folder), local_files_only=True).eval()
    with torch.no_grad():
        logits = loaded(input_ids=sample).logits
    diff = float((logits.float() - torch.as_tensor(ref).float()).abs().max())
    return {"class": type(loaded).__name__, "max_abs_diff": diff, "special_tokens": ids}


def _lin(dst: Any, src: torch.nn.Linear, transpose: bool = False) -> None:
    dst.weight.copy_(src.weight.t() if transpose else src.weight)
    if getattr(dst, "bias", None) is not None:
        dst.bias.copy_(src.bias)


@torch.no_grad()
def _to_gpt2(model: torch.nn.Module) -> Any:
    import transformers

    s = model.spec
    cfg = transformers.GPT2Config(
        vocab_size=s.vocab_size,
        n_positions=s.max_seq_len,
        n_embd=s.d_model,
        n_layer=s.n_layer,
        n_head=s.n_head,
        n_inner=s.d_ff,
        activation_function="gelu",
        resid_pdrop=s.dropout,
        embd_pdrop=s.dropout,
        attn_pdrop=s.dropout,
        layer_norm_epsilon=s.layer_norm_eps,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
    )
    hf = transformers.GPT2LMHeadModel(cfg)
    t = hf.transformer
    t.wte.weight.copy_(model.wte.weight)
    t.wpe.weight.copy_(model.wpe.weight)
    for h, b in zip(t.h, model.blocks):  # HF's Conv1D keeps [in, out]: the transposed Linear
        _lin(h.ln_1, b.ln_1)
        _lin(h.attn.c_attn, b.attn.qkv, transpose=True)
        _lin(h.attn.c_proj, b.attn.proj, transpose=True)
        _lin(h.ln_2, b.ln_2)
        _lin(h.mlp.c_fc, b.mlp.fc, transpose=True)
        _lin(h.mlp.c_proj, b.mlp.proj, transpose=True)
    _lin(t.ln_f, model.ln_f)
    hf.tie_weights()
    return hf


@torch.no_grad()
def _to_bert(model: torch.nn.Module) -> Any:
    import transformers

    s = model.spec
    cfg = transformers.BertConfig(
        vocab_size=s.vocab_size,
        hidden_size=s.d_model,
        num_hidden_layers=s.n_layer,
        num_attention_heads=s.n_head,
        intermediate_size=s.d_ff,
        hidden_act="gelu",
        max_position_embeddings=s.max_seq_len,
        type_vocab_size=s.type_vocab_size,
        layer_norm_eps=s.layer_norm_eps,
        hidden_dropout_prob=s.dropout,
        attention_probs_dropout_prob=s.dropout,
        tie_word_embeddings=True,
    )
    hf = transformers.BertForMaskedLM(cfg)
    e, d = hf.bert.embeddings, s.d_model
    e.word_embeddings.weight.copy_(model.embeddings.word.weight)
    e.position_embeddings.weight.copy_(model.embeddings.position.weight)
    e.token_type_embeddings.weight.copy_(model.embeddings.token_type.weight)
    _lin(e.LayerNorm, model.embeddings.ln)
    for h, b in zip(hf.bert.encoder.layer, model.layers):
        att = h.attention.self
        for i, proj in enumerate((att.query, att.key, att.value)):  # the fused qkv, split in its order
            proj.weight.copy_(b.attn.qkv.weight[i * d : (i + 1) * d])
            proj.bias.copy_(b.attn.qkv.bias[i * d : (i + 1) * d])
        _lin(h.attention.output.dense, b.attn.proj)
        _lin(h.attention.output.LayerNorm, b.ln_1)
        _lin(h.intermediate.dense, b.mlp.fc)
        _lin(h.output.dense, b.mlp.proj)
        _lin(h.output.LayerNorm, b.ln_2)
    p = hf.cls.predictions
    _lin(p.transform.dense, model.mlm.dense)
    _lin(p.transform.LayerNorm, model.mlm.ln)
    p.bias.copy_(model.mlm.bias)
    hf.tie_weights()
    return hf
