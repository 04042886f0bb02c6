"""#16: `model.hf` (a Hugging Face model from a local folder or config.json) in the trainer, and its export.

Each check compares with eager PyTorch: the accelerated HF model's losses against the same model trained with
train.accelerate=false, the exported folder's logits against the trained model's."""

from __future__ import annotations

import json

import pytest
import torch

from graphtrain import Trainer
from graphtrain.config.sections import Config, ModelConfig

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("tiny_env")

TINY = [
    "data.seq_len=32",
    "data.vocab_size=512",
    "train.batch_size=2",
    "train.steps=3",
    "train.eval_every=0",
    "train.eval_batches=1",
    "train.progress=false",
    "train.threads=1",
    "train.sample_tokens=0",
    "train.loggers=[jsonl]",
    "train.log_every=1",
    "train.deterministic=true",
]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """A tiny Llama (GQA) config folder, a tiny BERT folder with safetensors weights, a .jsonl of text."""
    root = tmp_path_factory.mktemp("hf")
    llama = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        architectures=["LlamaForCausalLM"],
    )
    llama.save_pretrained(root / "llama")
    torch.manual_seed(0)
    bert = transformers.BertForMaskedLM(
        transformers.BertConfig(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=64,
        )
    )
    bert.save_pretrained(root / "bert", safe_serialization=True)
    import sysconfig
    from pathlib import Path

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    with open(root / "corpus.jsonl", "w") as f:
        for p in sorted(stdlib.glob("*.py"))[:25]:
            f.write(json.dumps({"name": p.name, "content": p.read_text()[:6000]}) + "\n")
    return root


def _losses(run) -> list[float]:
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    return [r["loss"] for r in rows if r["kind"] == "train"]


def test_llama_from_config_trains_through_the_engine_like_eager(hf_dirs, tmp_path):
    """model.hf=config.json + data.path=.jsonl + data.text_field: the engine's losses match eager's (fp32 table:
    rtol 1e-4 for fused kernels), and the report shows the fused RMSNorm, attention and loss."""
    import graphtrain

    common = [
        *TINY,
        f"model.hf={hf_dirs / 'llama' / 'config.json'}",
        f"data.path={hf_dirs / 'corpus.jsonl'}",
        "data.text_field=content",
        "engine.provider=aten",
    ]
    runs = {}
    for accel in ("true", "false"):
        out = tmp_path / accel
        t = Trainer(Config().with_overrides([*common, f"train.accelerate={accel}", f"train.out_dir={out}"]))
        assert type(t.strategy.module).__name__ == "HFLanguageModel" and t.family == "gpt2"
        t.fit()
        runs[accel] = (t, out)
    fast, slow = _losses(runs["true"][1]), _losses(runs["false"][1])
    assert len(fast) == 3 and fast == pytest.approx(slow, rel=1e-4), (fast, slow)
    fused = {f["name"]: f["count"] for f in graphtrain.report(runs["true"][0].model).fused_ops}
    assert fused.get("rms_norm", 0) >= 5 and fused.get("attention", 0) >= 2, fused  # train (and eval) graphs
    assert "linear_cross_entropy" in fused or "cross_entropy" in fused, fused
    # the checkpoint names the HF model and holds the tokenizer it trained with
    from graphtrain.trainer.checkpoint import checkpoint_meta, checkpoint_tokenizer, latest_checkpoint

    ckpt = latest_checkpoint(runs["true"][1])
    meta = checkpoint_meta(ckpt)
    assert meta["model_spec"]["hf_type"] == "llama" and meta["config"]["model"]["hf"].endswith("config.json")
    assert checkpoint_tokenizer(ckpt).digest() == runs["true"][0].data.tokenizer.digest()
    # what it trained leaves as itself: the transformers model's own safetensors, and ONNX checked by onnxruntime
    from graphtrain.runs.export import ONNX_ATOL, export_run

    st = export_run(runs["true"][1], "safetensors", tmp_path / "st")
    assert st["max_abs_diff"] == 0.0
    from safetensors.torch import load_file

    assert any(
        k.startswith("model.layers.0.self_attn.q_proj") for k in load_file(tmp_path / "st" / "model.safetensors")
    )
    pytest.importorskip("onnxruntime")
    assert export_run(runs["true"][1], "onnx", tmp_path / "onnx")["max_abs_diff"] <= ONNX_ATOL


def test_pretrained_folder_loads_its_safetensors_weights(hf_dirs):
    from graphtrain.models import build_model

    m = build_model(ModelConfig(hf=str(hf_dirs / "bert")))
    ref = transformers.AutoModelForMaskedLM.from_pretrained(
        hf_dirs / "bert", local_files_only=True, attn_implementation="eager"
    )  # model.attention explicit
    assert m.objective == "mlm" and m.family == "bert" and m.spec.n_layer == 2
    for (name, a), (_, b) in zip(m.hf.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), name
    # logits are the HF model's; the loss is the mean cross-entropy over the labelled positions
    ids = torch.randint(5, 512, (2, 16))
    labels = torch.full_like(ids, -100)
    labels[:, 3] = ids[:, 3]
    m.eval(), ref.eval()
    with torch.no_grad():
        logits = ref(input_ids=ids).logits
        assert torch.equal(m(ids), logits)
        want = torch.nn.functional.cross_entropy(logits[:, 3], ids[:, 3])
        assert torch.allclose(m(ids, labels), want, rtol=1e-6)


def test_bert_mlm_with_a_users_tokenizer_then_export_hf(hf_dirs, tmp_path):
    """data.tokenizer: a WordPiece tokenizer folder ([CLS]/[SEP]/[MASK] from its vocabulary); the run's export
    is a folder AutoModelForMaskedLM + AutoTokenizer load, with the trained logits."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    from graphtrain.runs.export import export_run, load_run

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer, tok.pre_tokenizer = normalizers.BertNormalizer(lowercase=True), pre_tokenizers.BertPreTokenizer()
    texts = [json.loads(line)["content"] for line in open(hf_dirs / "corpus.jsonl")]
    tok.train_from_iterator(
        texts, trainers.WordPieceTrainer(vocab_size=400, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    )
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    out = tmp_path / "run"
    t = Trainer(
        Config().with_overrides(
            [
                *TINY,
                f"model.hf={hf_dirs / 'bert'}",
                f"data.path={hf_dirs / 'corpus.jsonl'}",
                "data.text_field=content",
                f"data.tokenizer={tmp_path / 'tok'}",
                "engine.provider=aten",
                f"train.out_dir={out}",
            ]
        )
    )
    assert t.family == "bert" and t.data.tokenizer.mask_id == tok.token_to_id("[MASK]")
    batch = t.data.train.get_batch(0, 2)
    assert (batch["input_ids"][:, 0] == tok.token_to_id("[CLS]")).all()
    t.fit()
    r = export_run(out, "hf", tmp_path / "hf")
    loaded = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    fast_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert fast_tok.mask_token == "[MASK]" and fast_tok.convert_tokens_to_ids("[MASK]") == tok.token_to_id("[MASK]")
    _, model, _ = load_run(out)
    ids = torch.randint(5, 400, (2, 12))
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, model(ids), atol=1e-5)
    assert r["max_abs_diff"] <= 1e-5 and r["class"] == "BertForMaskedLM"


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda root: root / "missing", "does not exist"),
        (lambda root: root, "no config.json"),
        (lambda root: (root / "notes.txt").write_text("x") and root / "notes.txt", "not a config.json"),
    ],
)
def test_bad_model_hf_paths_name_the_fix(tmp_path, make, match):
    from graphtrain.models import build_model

    with pytest.raises(ValueError, match=match):
        build_model(ModelConfig(hf=str(make(tmp_path))))


def test_model_hf_errors_name_the_fix(hf_dirs, tmp_path):
    from graphtrain.models import build_model, resolve_spec

    with pytest.raises(ValueError, match=r"data.vocab_size <= 512"):  # the tokenizer would not fit the embedding
        resolve_spec(ModelConfig(hf=str(hf_dirs / "llama")), vocab_size=8192)
    (tmp_path / "pt").mkdir()
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=300).save_pretrained(tmp_path / "pt")
    (tmp_path / "pt" / "pytorch_model.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match="safetensors only"):
        build_model(ModelConfig(hf=str(tmp_path / "pt")))
    (tmp_path / "t5").mkdir()
    transformers.T5Config(d_model=32, num_layers=1, num_heads=2, vocab_size=300).save_pretrained(tmp_path / "t5")
    with pytest.raises(ValueError, match="model.objective=clm or model.objective=mlm"):
        resolve_spec(ModelConfig(hf=str(tmp_path / "t5")))
    with pytest.raises(ValueError, match="applies to model.hf models only"):
        ModelConfig(objective="clm")
    (tmp_path / "mamba").mkdir()  # attention-free: the Trainer cannot size it, and says where it trains
    transformers.MambaConfig(hidden_size=32, num_hidden_layers=1, vocab_size=300).save_pretrained(tmp_path / "mamba")
    with pytest.raises(ValueError, match=r"attention-free.*graphtrain.accelerate in your own loop"):
        resolve_spec(ModelConfig(hf=str(tmp_path / "mamba"), objective="clm"))
    # an objective the architecture has no head for
    with pytest.raises(ValueError, match="cannot build a mlm model"):
        build_model(ModelConfig(hf=str(hf_dirs / "llama"), objective="mlm"))


def test_pipeline_parallel_refuses_hf_models_with_the_fix(hf_dirs):
    with pytest.raises(ValueError, match="has no plan for model.hf models yet.*parallel.pp=1"):
        Trainer(Config().with_overrides([*TINY, f"model.hf={hf_dirs / 'llama'}", "parallel.pp=2"]))


def test_shipped_llama_job_builds_offline():
    """configs/hf-llama-mini.yaml (a Llama config.json in the repository, the default corpus): the job resolves to
    a GQA Llama causal LM without touching the network."""
    from pathlib import Path

    from graphtrain.models import resolve_spec

    root = Path(__file__).resolve().parents[1]
    config = Config.from_yaml(root / "configs" / "hf-llama-mini.yaml")
    hf = str(root / config.model.hf)
    spec = resolve_spec(ModelConfig(**{**config.model.__dict__, "hf": hf}), vocab_size=config.data.vocab_size)
    assert (spec.hf_type, spec.family, spec.n_layer, spec.d_model, spec.vocab_size) == ("llama", "gpt2", 4, 256, 8192)
    assert config.train.out_dir == "runs/hf-llama-mini" and config.model.attention == "sdpa"
