"""Hugging Face architectures graphtrain was not tuned on, built from their configs (random init, nothing
downloaded): the held-out style check of #20 across families. One table serves the step benchmark
(``python -m graphtrain.bench.step --model hf:deberta2 --variants eager,graphtrain``) and the parity tests
(tests/test_hf_families.py, tiny sizes, dropout off).

Each family is built at a given width, depth and vocabulary with the library's defaults otherwise (dropout and
stochastic depth as the config sets them, unless ``dropout=False``), SDPA attention where the family has it and
its eager attention where it has not (Bloom, GPT-J, DeBERTa-v2, T5). Language models get token ids and labels
(masked-LM families: 15% of tokens masked, the rest ignored; seq2seq: the labels double as decoder inputs, which
the model shifts itself); vision models 224 px images (32 px when narrower than 64) and class labels; speech models
a random waveform and character targets (CTC), or log-mel features and target tokens (Whisper).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Family:
    config: str
    model: str
    kwargs: Callable[[int, int, int, int], dict[str, Any]]
    """(hidden, layers, heads, vocab) -> config kwargs."""
    attention: str = "sdpa"
    task: str = "clm"
    """clm (causal LM), mlm (masked LM), seq2seq, image, ctc (speech to characters) or speech2seq."""
    graph_breaks: bool = False
    """The library's code breaks Dynamo's graph in training (Wav2Vec2: a lock taken on the first call, setting
    requires_grad on an activation, a branch on the labels' values in its CTC loss): a full-graph capture fails."""


_IDS = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0)


def _dec(h: int, n: int, a: int, v: int, **kw: Any) -> dict[str, Any]:
    return (
        dict(
            hidden_size=h,
            num_hidden_layers=n,
            num_attention_heads=a,
            intermediate_size=4 * h,
            max_position_embeddings=1024,
            vocab_size=v,
            **_IDS,
        )
        | kw
    )


def _enc_dec(h: int, n: int, a: int, v: int, **kw: Any) -> dict[str, Any]:
    """An encoder-decoder's config (BART's names, which Whisper shares): half the layers on each side."""
    return (
        dict(
            d_model=h,
            encoder_layers=max(1, n // 2),
            decoder_layers=max(1, n // 2),
            encoder_attention_heads=a,
            decoder_attention_heads=a,
            encoder_ffn_dim=4 * h,
            decoder_ffn_dim=4 * h,
            vocab_size=v,
            decoder_start_token_id=0,
            **_IDS,
        )
        | kw
    )


FAMILIES: dict[str, Family] = {
    "bert": Family("BertConfig", "BertForMaskedLM", _dec, task="mlm"),
    "roberta": Family(
        "RobertaConfig", "RobertaForMaskedLM", lambda h, n, a, v: _dec(h, n, a, v, pad_token_id=1), task="mlm"
    ),
    "distilbert": Family(
        "DistilBertConfig",
        "DistilBertForMaskedLM",
        lambda h, n, a, v: dict(
            dim=h, n_layers=n, n_heads=a, hidden_dim=4 * h, vocab_size=v, max_position_embeddings=1024, **_IDS
        ),
        task="mlm",
    ),
    "electra": Family(
        "ElectraConfig", "ElectraForMaskedLM", lambda h, n, a, v: _dec(h, n, a, v, embedding_size=h), task="mlm"
    ),
    "albert": Family(
        "AlbertConfig",
        "AlbertForMaskedLM",
        lambda h, n, a, v: _dec(h, n, a, v, embedding_size=max(16, h // 2)),
        task="mlm",
    ),
    "deberta2": Family("DebertaV2Config", "DebertaV2ForMaskedLM", _dec, attention="eager", task="mlm"),
    "gpt2": Family(
        "GPT2Config",
        "GPT2LMHeadModel",
        lambda h, n, a, v: dict(n_embd=h, n_layer=n, n_head=a, n_positions=1024, vocab_size=v, **_IDS),
    ),
    "llama": Family(
        "LlamaConfig",
        "LlamaForCausalLM",
        lambda h, n, a, v: _dec(h, n, a, v, num_key_value_heads=max(1, a // 2), intermediate_size=int(2.75 * h)),
    ),
    "qwen2": Family(
        "Qwen2Config", "Qwen2ForCausalLM", lambda h, n, a, v: _dec(h, n, a, v, num_key_value_heads=max(1, a // 2))
    ),
    "qwen3": Family(
        "Qwen3Config",
        "Qwen3ForCausalLM",
        lambda h, n, a, v: _dec(h, n, a, v, num_key_value_heads=max(1, a // 2), head_dim=h // a),
    ),
    "mistral": Family(
        "MistralConfig", "MistralForCausalLM", lambda h, n, a, v: _dec(h, n, a, v, num_key_value_heads=max(1, a // 2))
    ),
    "gemma": Family(
        "GemmaConfig",
        "GemmaForCausalLM",
        lambda h, n, a, v: _dec(h, n, a, v, num_key_value_heads=max(1, a // 2), head_dim=h // a),
    ),
    # q and k normalized after the heads move in front ([B, S, H, D] seen as [B, H, S, D]), every other layer on a
    # sliding window: passes/fuse_layer_norm.py keeps such a norm's layout
    "gemma3": Family(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        lambda h, n, a, v: _dec(h, n, a, v, num_key_value_heads=max(1, a // 2), head_dim=h // a, sliding_window=16),
    ),
    # a mixture of experts: a router picks 2 of 4 expert MLPs per token
    "mixtral": Family(
        "MixtralConfig",
        "MixtralForCausalLM",
        lambda h, n, a, v: _dec(
            h,
            n,
            a,
            v,
            num_key_value_heads=max(1, a // 2),
            intermediate_size=2 * h,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),  # fmt: skip
    ),
    # multi-head latent attention (keys built by copies into a new tensor: pipeline/trace.py differentiable_copies)
    # and a routed mixture of experts after one dense layer
    "deepseek3": Family(
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        lambda h, n, a, v: _dec(
            h,
            n,
            a,
            v,
            num_key_value_heads=a,
            intermediate_size=2 * h,
            moe_intermediate_size=h,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=h // 2,
            kv_lora_rank=h // 2,
            qk_nope_head_dim=h // a // 2,
            qk_rope_head_dim=h // a // 2,
            v_head_dim=h // a,
        ),  # fmt: skip
    ),
    # linear attention (gated delta rule, chunked) in every other layer, a routed mixture of experts with a shared
    # expert in each: its backward views a cat of gate gradients (passes/graph_utils.py views_as_reshapes)
    "qwen3next": Family(
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        lambda h, n, a, v: _dec(
            h,
            n,
            a,
            v,
            num_key_value_heads=max(1, a // 2),
            head_dim=h // a,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=h,
            shared_expert_intermediate_size=h,
            linear_num_key_heads=max(1, a // 2),
            linear_num_value_heads=a,
            linear_key_head_dim=h // a,
            linear_value_head_dim=h // a,
            layer_types=["linear_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
        ),  # fmt: skip
    ),
    # a state-space model, no attention: its selective scan runs torch.vmap, which Dynamo inlines as functorch
    # transforms (pipeline/trace.py _runs_functorch_transforms)
    "mamba": Family(
        "MambaConfig",
        "MambaForCausalLM",
        lambda h, n, a, v: dict(hidden_size=h, num_hidden_layers=n, vocab_size=v, state_size=8, **_IDS),
        attention="eager",  # no attention at all; transformers refuses the sdpa setting
    ),
    "phi3": Family("Phi3Config", "Phi3ForCausalLM", lambda h, n, a, v: _dec(h, n, a, v, num_key_value_heads=a)),
    "phi": Family("PhiConfig", "PhiForCausalLM", _dec),
    "neox": Family("GPTNeoXConfig", "GPTNeoXForCausalLM", _dec),
    "opt": Family(
        "OPTConfig",
        "OPTForCausalLM",
        lambda h, n, a, v: dict(
            hidden_size=h,
            num_hidden_layers=n,
            num_attention_heads=a,
            ffn_dim=4 * h,
            word_embed_proj_dim=h,
            max_position_embeddings=1024,
            vocab_size=v,
            **_IDS,
        ),
    ),
    "bloom": Family(
        "BloomConfig",
        "BloomForCausalLM",
        lambda h, n, a, v: dict(hidden_size=h, n_layer=n, n_head=a, vocab_size=v, **_IDS),
        attention="eager",
    ),
    "falcon": Family(
        "FalconConfig",
        "FalconForCausalLM",
        lambda h, n, a, v: dict(hidden_size=h, num_hidden_layers=n, num_attention_heads=a, vocab_size=v, **_IDS),
    ),
    "gptj": Family(
        "GPTJConfig",
        "GPTJForCausalLM",
        lambda h, n, a, v: dict(
            n_embd=h, n_layer=n, n_head=a, rotary_dim=h // a // 2, n_positions=1024, vocab_size=v, **_IDS
        ),
        attention="eager",
    ),
    "stablelm": Family(
        "StableLmConfig", "StableLmForCausalLM", lambda h, n, a, v: _dec(h, n, a, v, num_key_value_heads=a)
    ),
    "starcoder2": Family(
        "Starcoder2Config",
        "Starcoder2ForCausalLM",
        lambda h, n, a, v: _dec(h, n, a, v, num_key_value_heads=max(1, a // 2)),
    ),
    "bigcode": Family(
        "GPTBigCodeConfig",
        "GPTBigCodeForCausalLM",
        lambda h, n, a, v: dict(n_embd=h, n_layer=n, n_head=a, n_positions=1024, vocab_size=v, **_IDS),
    ),
    "olmo2": Family("Olmo2Config", "Olmo2ForCausalLM", lambda h, n, a, v: _dec(h, n, a, v, num_key_value_heads=a)),
    "granite": Family(
        "GraniteConfig", "GraniteForCausalLM", lambda h, n, a, v: _dec(h, n, a, v, num_key_value_heads=max(1, a // 2))
    ),
    "modernbert": Family(
        "ModernBertConfig",
        "ModernBertForMaskedLM",
        lambda h, n, a, v: dict(
            hidden_size=h,
            num_hidden_layers=n,
            num_attention_heads=a,
            intermediate_size=2 * h,
            max_position_embeddings=1024,
            vocab_size=v,
            pad_token_id=0,
            bos_token_id=None,
            eos_token_id=None,
            cls_token_id=1,
            sep_token_id=2,
        ),
        task="mlm",
    ),
    "t5": Family(
        "T5Config",
        "T5ForConditionalGeneration",
        lambda h, n, a, v: dict(
            d_model=h,
            d_kv=h // a,
            d_ff=4 * h,
            num_layers=n,
            num_heads=a,
            vocab_size=v,
            decoder_start_token_id=0,
            **_IDS,
        ),
        attention="eager",
        task="seq2seq",
    ),
    "bart": Family(
        "BartConfig",
        "BartForConditionalGeneration",
        lambda h, n, a, v: _enc_dec(h, n, a, v, max_position_embeddings=1024),
        task="seq2seq",
    ),
    "vit": Family(
        "ViTConfig",
        "ViTForImageClassification",
        lambda h, n, a, v: dict(
            hidden_size=h,
            num_hidden_layers=n,
            num_attention_heads=a,
            intermediate_size=4 * h,
            num_labels=100,
            image_size=_image(h),
            patch_size=16 if h >= 64 else 8,
        ),
        task="image",
    ),
    "swin": Family(
        "SwinConfig",
        "SwinForImageClassification",
        lambda h, n, a, v: dict(
            embed_dim=max(16, h // 8 * 3 // 2),
            depths=[2] * max(1, n // 2),
            num_heads=[2 * 2**i for i in range(max(1, n // 2))],
            num_labels=100,
            image_size=_image(h),
            window_size=7 if h >= 64 else 4,
        ),
        task="image",
    ),
    "wav2vec2": Family(
        "Wav2Vec2Config",
        "Wav2Vec2ForCTC",
        lambda h, n, a, v: dict(
            hidden_size=h,
            num_hidden_layers=n,
            num_attention_heads=a,
            intermediate_size=4 * h,
            vocab_size=v,
            conv_dim=(h, h),
            conv_stride=(5, 2),
            conv_kernel=(10, 3),
            num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=4,
            mask_time_prob=0.0,  # SpecAugment draws its masks with NumPy: eager and graphtrain would differ
            ctc_loss_reduction="mean",
            **_IDS,
        ),
        attention="sdpa",
        task="ctc",
        graph_breaks=True,
    ),
    "whisper": Family(
        "WhisperConfig",
        "WhisperForConditionalGeneration",
        lambda h, n, a, v: _enc_dec(
            h,
            n,
            a,
            v,
            num_mel_bins=16,
            max_source_positions=64,
            max_target_positions=1024,
            suppress_tokens=[],
            begin_suppress_tokens=[],
        ),
        task="speech2seq",
    ),
}


def _image(hidden: int) -> int:
    return 224 if hidden >= 64 else 32


def _no_dropout(cfg: Any) -> None:
    for k, v in list(vars(cfg).items()):
        if isinstance(v, float) and any(s in k for s in ("dropout", "pdrop", "drop_path", "drop_rate", "layerdrop")):
            setattr(cfg, k, 0.0)


def build_family(
    name: str,
    *,
    hidden: int = 256,
    layers: int = 4,
    vocab: int = 8192,
    batch: int = 8,
    seq: int = 128,
    dropout: bool = True,
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """(model in train mode, one fixed batch) for family `name` (module docstring). `overrides`: config keys set
    after the family's own (e.g. Mistral's ``sliding_window``, shorter than the sequence to make it slide)."""
    import transformers

    if name not in FAMILIES:
        raise ValueError(f"unknown family {name!r}: choose from {', '.join(FAMILIES)}")
    fam = FAMILIES[name]
    heads = max(4, hidden // 64)
    cfg = getattr(transformers, fam.config)(**(fam.kwargs(hidden, layers, heads, vocab) | (overrides or {})))
    if not dropout:
        _no_dropout(cfg)
    cfg._attn_implementation = fam.attention
    torch.manual_seed(seed)
    model = getattr(transformers, fam.model)(cfg).train()
    g = torch.Generator().manual_seed(seed + 1)
    if fam.task == "image":
        size = _image(hidden)
        return model, {
            "pixel_values": torch.randn(batch, 3, size, size, generator=g),
            "labels": torch.randint(0, cfg.num_labels, (batch,), generator=g),
        }
    if fam.task == "ctc":  # a waveform of `seq` frames (the feature encoder's stride is 10), targets a quarter as long
        return model, {
            "input_values": torch.randn(batch, 10 * seq, generator=g),
            "labels": torch.randint(1, vocab, (batch, max(1, seq // 4)), generator=g),
        }
    if fam.task == "speech2seq":  # log-mel features (two frames per encoder position), `seq` target tokens
        return model, {
            "input_features": torch.randn(batch, cfg.num_mel_bins, 2 * cfg.max_source_positions, generator=g),
            "labels": torch.randint(5, vocab, (batch, seq), generator=g),
        }
    ids = torch.randint(5, vocab, (batch, seq), generator=g)
    labels = ids.clone()
    if fam.task == "mlm":
        picked = torch.rand(ids.shape, generator=g) < 0.15
        picked[:, 0] = True  # at least one target per sample
        labels, ids = torch.where(picked, ids, -100), torch.where(picked, 4, ids)
    return model, {"input_ids": ids, "labels": labels}
