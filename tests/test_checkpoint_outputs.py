"""Checkpoints people expect (issue #51 item 3): train.keep_last, train.keep_best (ckpt-best.pt), a model state
dict that loads into the plain model with no prefix surgery (older prefixed checkpoints still resume), and
train.export_hf's Hugging Face folder at the end of a run."""

from __future__ import annotations

import json
import os

import pytest
import torch

from graphtrain import Trainer
from graphtrain.config.sections import Config
from graphtrain.trainer import checkpoint as ck
from graphtrain.trainer import run_outputs as ro
from graphtrain.trainer.resume import clean_orphans, supersede_later

pytestmark = pytest.mark.usefixtures("tiny_env")
TINY = [
    "data.seq_len=32",
    "data.vocab_size=512",
    "data.max_bytes=300000",
    "train.batch_size=2",
    "train.eval_batches=1",
    "train.progress=false",
    "train.threads=1",
    "train.accelerate=false",
    "train.sample_tokens=0",
    "train.loggers=[jsonl]",
    "model.name=gpt2-tiny",
]


def _state(step: int, val_loss: float) -> dict:
    torch.manual_seed(step)
    model = torch.nn.Linear(4, 3)
    return {
        "format_version": ck.FORMAT_VERSION,
        "step": step,
        "model": model.state_dict(),
        "optimizer": {},
        "rng": ck.rng_state(),
        "config": Config().to_dict(),
        "model_spec": None,
        "metrics": {"val_loss": val_loss, "val_step": step},
    }


def _save(out, step, val_loss):
    return ck.save_checkpoint(ck.checkpoint_path(out, step), _state(step, val_loss))


def _evals(run) -> dict[int, float]:
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    return {r["step"]: r["val_loss"] for r in rows if r["kind"] == "eval"}


def test_best_is_the_lowest_loss_and_outlives_pruning(tmp_path):
    for step, loss in [(1, 3.0), (2, 2.0), (3, 2.5), (4, float("nan"))]:
        path = _save(tmp_path, step, loss)
        ck.prune_checkpoints(tmp_path, keep=1, protect=path)
        changed = ro.update_best(tmp_path, path, loss)
        assert changed == (step in (1, 2)), step
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [4]  # the best is no ckpt-N: never pruned, never latest
    best = ro.best_checkpoint(tmp_path)
    assert best.name == "ckpt-best.pt" and ro.best_info(tmp_path)[1:] == (2, 2.0)
    loaded = ck.load_checkpoint(best)  # verified against its own checksum file, which names it
    assert loaded["step"] == 2 and torch.equal(loaded["model"]["weight"], _state(2, 0)["model"]["weight"])
    assert (tmp_path / "ckpt-best.pt.sha256").read_text().split()[1] == "ckpt-best.pt"
    assert ck.latest_valid_checkpoint(tmp_path).name == "ckpt-0000004.pt"


def test_best_is_a_hard_link_and_a_corrupt_best_is_replaced(tmp_path):
    path = _save(tmp_path, 1, 3.0)
    assert ro.update_best(tmp_path, path, 3.0)
    assert os.stat(tmp_path / "ckpt-best.pt").st_ino == os.stat(path).st_ino  # no copy of the weights
    data = bytearray((tmp_path / "ckpt-best.pt").read_bytes())  # both names see a flipped byte: write a new file
    os.unlink(tmp_path / "ckpt-best.pt")
    data[len(data) // 2] ^= 0xFF
    (tmp_path / "ckpt-best.pt").write_bytes(bytes(data))
    assert ro.best_info(tmp_path) is None  # it does not verify: any new evaluated save replaces it
    assert ro.update_best(tmp_path, _save(tmp_path, 2, 9.0), 9.0)
    assert ro.best_info(tmp_path)[1:] == (2, 9.0)


def test_resume_from_an_earlier_step_moves_a_later_best_aside(tmp_path):
    for step, loss in [(1, 3.0), (2, 2.0)]:
        ro.update_best(tmp_path, _save(tmp_path, step, loss), loss)
    folder, moved = supersede_later(tmp_path, 1)
    assert set(moved) == {"ckpt-0000002.pt", "ckpt-best.pt"} and ro.best_checkpoint(tmp_path) is None
    assert (folder / "ckpt-best.pt.sha256").is_file() and ck.load_checkpoint(folder / "ckpt-best.pt")["step"] == 2


def test_leftovers_of_a_killed_best_swap_or_hf_export_are_cleaned(tmp_path):
    (tmp_path / ".ckpt-best.pt.123.tmp").write_bytes(b"x")
    (tmp_path / "ckpt-best.pt.sha256").write_text("0" * 64 + "  ckpt-best.pt\n")  # its checkpoint never arrived
    (tmp_path / ".hf.tmp").mkdir()
    (tmp_path / ".hf.tmp" / "config.json").write_text("{}")
    done = clean_orphans(tmp_path)
    assert sorted(done) == [".ckpt-best.pt.123.tmp", ".hf.tmp/", "ckpt-best.pt.sha256"]
    assert not any(tmp_path.iterdir())


class _ScriptedValidation(Trainer):
    """The validation losses of a run whose loss rose after its second evaluation (5.0, 4.0, 4.5): the weights, the
    saves, pruning and the choice of the best are the Trainer's own."""

    def evaluate(self) -> float:
        return {2: 5.0, 4: 4.0, 6: 4.5}.get(self.step, super().evaluate())


def test_keep_last_and_keep_best_in_a_run(tmp_path):
    run = tmp_path / "run"
    common = [*TINY, "train.ckpt_every=1", "train.eval_every=2", "optim.lr=3e-2", f"train.out_dir={run}"]
    _ScriptedValidation(
        Config().with_overrides([*common, "train.steps=6", "train.keep_last=2", "train.keep_best=true"])
    ).fit()
    assert [s for s, _ in ck.list_checkpoints(run)] == [5, 6]
    assert _evals(run) == {2: 5.0, 4: 4.0, 6: 4.5}
    path, step, loss = ro.best_info(run)  # step 4's checkpoint, pruned as ckpt-0000004.pt, lives on as the best
    assert (path.name, step, loss) == ("ckpt-best.pt", 4, 4.0)
    assert ck.load_checkpoint(path)["metrics"]["val_step"] == 4
    from graphtrain.runs.export import load_run

    _, _, used = load_run(run, "best")  # graphtrain export RUN --checkpoint best
    assert used == path
    # keep_last 0 keeps them all; a resume may change both keys without naming them; real validation losses now
    Trainer(
        Config().with_overrides([*common, "train.steps=8", "train.keep_last=0", "train.keep_best=true"]), resume=True
    ).fit()
    assert [s for s, _ in ck.list_checkpoints(run)] == [5, 6, 7, 8]
    evals = _evals(run)
    assert ro.best_info(run)[1] == (4 if evals[8] >= 4.0 else 8), evals


def test_keep_last_is_checked():
    with pytest.raises(ValueError, match="train.keep_last must be >= 0"):
        Config().with_overrides(["train.keep_last=-1"])


@pytest.fixture(scope="module")
def llama_cfg(tmp_path_factory):
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
    ).save_pretrained(root)
    return root / "config.json"


def test_model_hf_checkpoint_loads_into_the_transformers_class_and_old_prefixed_ones_resume(llama_cfg, tmp_path):
    import transformers

    run = tmp_path / "run"
    common = [*TINY, f"model.hf={llama_cfg}", "train.eval_every=0", f"train.out_dir={run}", "train.ckpt_every=2"]
    Trainer(Config().with_overrides([*common, "train.steps=2"])).fit()
    path = ck.latest_checkpoint(run)
    state = torch.load(path, weights_only=True)
    plain = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(llama_cfg.parent))
    plain.load_state_dict(state["model"])  # strict: every key of the transformers class, none of graphtrain's
    assert not any(k.startswith("hf.") for k in state["model"])
    # a checkpoint written before plain keys (the wrapper's `hf.` on every key) still resumes and exports
    old = {**state, "model": {f"hf.{k}": v for k, v in state["model"].items()}}
    ck.save_checkpoint(path, old)
    t = Trainer(Config().with_overrides([*common, "train.steps=4"]), resume=True)
    assert t.fit()["steps"] == 4
    again = torch.load(ck.latest_checkpoint(run), weights_only=True)["model"]
    assert set(again) == set(state["model"])  # saved plain again
    from graphtrain.runs.export import load_run

    _, model, _ = load_run(run, "2")  # the prefixed checkpoint
    assert torch.equal(model.hf.lm_head.weight, old["model"]["hf.lm_head.weight"])
    # train.init_from a plain-keyed checkpoint: the weights land in graphtrain's wrapper
    fresh = Trainer(
        Config().with_overrides(
            [
                *TINY,
                f"model.hf={llama_cfg}",
                f"train.out_dir={tmp_path / 'next'}",
                f"train.init_from={ck.latest_checkpoint(run)}",
            ]
        )
    )
    assert torch.equal(fresh.strategy.module.hf.lm_head.weight, again["lm_head.weight"])


def test_export_hf_writes_a_transformers_folder_at_the_end_of_the_run(tmp_path):
    import transformers

    run = tmp_path / "run"
    summary = Trainer(
        Config().with_overrides(
            [*TINY, "train.steps=2", "train.eval_every=0", "train.export_hf=true", f"train.out_dir={run}"]
        )
    ).fit()
    assert summary["hf_folder"] == str(run / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(run / "hf", local_files_only=True).eval()
    tok = transformers.AutoTokenizer.from_pretrained(run / "hf", local_files_only=True)
    assert model.generation_config.eos_token_id == tok.eos_token_id == 0
    from graphtrain.runs.export import load_run

    _, trained, _ = load_run(run)
    ids = torch.tensor([tok("import os\n")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, trained(ids), rtol=1e-5, atol=1e-5)
    assert not (run / ".hf.tmp").exists() and not (run / ".hf.old").exists()


@pytest.mark.dist
@pytest.mark.slow  # two ranks on the shared 2-core machine: 50 s
def test_sharded_run_keeps_its_best_folder_and_writes_the_hf_folder(tmp_path):
    """Two data-parallel ranks (gloo) write sharded checkpoints: the best is ckpt-best/, linked file by file and
    verified by its SHA256SUMS; export_hf reads the final sharded checkpoint on rank 0, and its logits are the
    checkpoint's."""
    import subprocess
    import sys

    import transformers

    from graphtrain.distributed.checkpoint import load_model_weights_local
    from graphtrain.models import build_model

    out = tmp_path / "dp2"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "graphtrain",
            "train",
            *TINY,
            "train.steps=4",
            "train.ckpt_every=1",
            "train.eval_every=1",
            "train.keep_last=1",
            "train.keep_best=true",
            "train.export_hf=true",
            "model.dropout=0.0",
            "parallel.dp=2",
            "--out",
            str(out),
            "--nproc",
            "2",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert [s for s, _ in ck.list_checkpoints(out)] == [4]
    evals = _evals(out)
    path, step, loss = ro.best_info(out)
    assert path.name == "ckpt-best" and ck.is_sharded(path) and ck.verify_checkpoint(path)
    assert step == min(evals, key=evals.get) and loss == pytest.approx(evals[step])
    assert not (out / "ckpt-best.tmp").exists() and not (out / "ckpt-best.old").exists()
    hf = transformers.AutoModelForCausalLM.from_pretrained(out / "hf", local_files_only=True).eval()
    config = Config.from_yaml(out / "config.yaml")
    model = build_model(config.model, vocab_size=hf.config.vocab_size)
    load_model_weights_local(ck.latest_checkpoint(out), model)
    ids = torch.randint(0, hf.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, model.eval()(ids), rtol=1e-5, atol=1e-5)
