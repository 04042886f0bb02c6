"""graphtrain export: safetensors, a Hugging Face folder and ONNX, each loaded by its consumer library and
compared with the trained model's logits (fp32)."""

from __future__ import annotations

import pytest
import torch

from graphtrain import Trainer
from graphtrain.config.sections import Config
from graphtrain.runs.export import export_run, load_run

pytestmark = pytest.mark.usefixtures("tiny_env")
TINY = [
    "data.seq_len=32",
    "data.vocab_size=512",
    "data.max_bytes=300000",
    "train.batch_size=2",
    "train.steps=2",
    "train.eval_every=0",
    "train.eval_batches=1",
    "train.progress=false",
    "train.threads=1",
    "train.accelerate=false",
    "train.sample_tokens=0",
    "train.loggers=[jsonl]",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    mp = pytest.MonkeyPatch()
    cache = tmp_path_factory.getbasetemp() / "graphtrain-cache"
    cache.mkdir(exist_ok=True)
    mp.setenv("GRAPHTRAIN_CACHE", str(cache))  # the data cache the other trainer tests share
    threads = torch.get_num_threads()
    for name in ("gpt2-tiny", "bert-tiny"):
        run = tmp_path_factory.mktemp(name)
        Trainer(Config().with_overrides([*TINY, f"model.name={name}", f"train.out_dir={run}"])).fit()
        out[name] = run
    torch.set_num_threads(threads)
    yield out
    mp.undo()


def _ids(model, seed=3):
    return torch.randint(0, model.spec.vocab_size, (2, 12), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", ["gpt2-tiny", "bert-tiny"])
def test_safetensors_loads_into_the_same_architecture(runs, name, tmp_path):
    from safetensors.torch import load_file

    r = export_run(runs[name], "safetensors", tmp_path / "st")
    _, model, _ = load_run(runs[name])
    fresh = type(model)(model.spec, attention=model.attention)
    fresh.load_state_dict(load_file(tmp_path / "st" / "model.safetensors"), strict=False)
    fresh.tie_weights()
    ids = _ids(model)
    with torch.no_grad():
        assert torch.equal(fresh.eval()(ids), model(ids))
    assert r["max_abs_diff"] == 0.0


@pytest.mark.parametrize("name,auto", [("gpt2-tiny", "AutoModelForCausalLM"), ("bert-tiny", "AutoModelForMaskedLM")])
def test_hugging_face_folder_gives_the_same_logits(runs, name, auto, tmp_path):
    import transformers

    r = export_run(runs[name], "hf", tmp_path / "hf")
    loaded = getattr(transformers, auto).from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    _, model, _ = load_run(runs[name])
    ids = _ids(model)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(ids), rtol=1e-5, atol=1e-5)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert len(tok("def f(x): return x")["input_ids"]) > 0 and r["tokenizer"].endswith("tokenizer.json")


def test_onnx_matches_pytorch_with_dynamic_axes(runs, tmp_path):
    import onnxruntime as ort

    r = export_run(runs["gpt2-tiny"], "onnx", tmp_path / "onnx")
    assert r["max_abs_diff"] <= 1e-4 and r["shapes_checked"][0] != r["shapes_checked"][1]
    _, model, _ = load_run(runs["gpt2-tiny"])
    ids = torch.randint(0, model.spec.vocab_size, (5, 9), generator=torch.Generator().manual_seed(7))
    got = ort.InferenceSession(str(tmp_path / "onnx" / "model.onnx")).run(["logits"], {"input_ids": ids.numpy()})[0]
    with torch.no_grad():
        assert float((torch.from_numpy(got) - model(ids)).abs().max()) <= 1e-4


def test_export_errors(runs, tmp_path):
    with pytest.raises(ValueError, match="not a graphtrain run directory"):
        export_run(tmp_path, "safetensors")
    with pytest.raises(ValueError, match="unknown export format 'gguf'"):
        export_run(runs["gpt2-tiny"], "gguf")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("keep me")
    with pytest.raises(ValueError, match="exists and is not empty"):
        export_run(runs["gpt2-tiny"], "safetensors", tmp_path / "busy")
    assert (tmp_path / "busy" / "x").read_text() == "keep me"


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    """A model.hf run: a tiny Llama from a config.json whose special ids (bos 1, eos 2: Llama's defaults) belong to
    another tokenizer, trained with graphtrain's own BPE (eos <|endoftext|> 0, pad [PAD] 1)."""
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("llama")
    transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(root / "cfg")
    mp = pytest.MonkeyPatch()
    cache = tmp_path_factory.getbasetemp() / "graphtrain-cache"
    cache.mkdir(exist_ok=True)
    mp.setenv("GRAPHTRAIN_CACHE", str(cache))
    threads = torch.get_num_threads()
    run = root / "run"
    Trainer(Config().with_overrides([*TINY, f"model.hf={root / 'cfg' / 'config.json'}", f"train.out_dir={run}"])).fit()
    torch.set_num_threads(threads)
    yield run
    mp.undo()


def test_hf_export_of_a_model_hf_run_generates_and_stops_at_eos(llama_run, tmp_path):
    """config.json and generation_config.json carry the exported tokenizer's ids, so transformers' generate()
    stops at the tokenizer's EOS; the logits still match the trained model's."""
    import json

    import transformers

    r = export_run(llama_run, "hf", tmp_path / "hf")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    eos = tok.eos_token_id
    assert tok.eos_token == "<|endoftext|>" and eos == 0 and tok.pad_token_id == 1  # graphtrain's BPE, not Llama's
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    for d in (cfg, gen):
        assert (d["eos_token_id"], d["bos_token_id"], d["pad_token_id"]) == (eos, eos, tok.pad_token_id), d
    assert r["special_tokens"] == {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 1}
    _, trained, _ = load_run(llama_run)
    ids = torch.tensor([tok("def f(x):\n    return")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, trained(ids), rtol=1e-5, atol=1e-5)
    # a model whose logits favour EOS from the third new token on: generate() ends there, with EOS
    new_tokens = []

    def favour_eos(module, args, logits):
        new_tokens.append(1)
        if len(new_tokens) >= 3:
            logits = logits.clone()
            logits[..., eos] += 1e4
        return logits

    model.lm_head.register_forward_hook(favour_eos)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=20, do_sample=False)
    new = out[0, ids.shape[1] :].tolist()
    assert len(new) == 3 and new[-1] == eos and eos not in new[:-1], new
    text = tok.decode(new, skip_special_tokens=True)
    assert "<|endoftext|>" not in text
