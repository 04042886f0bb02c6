"""`graphtrain` CLI: end to end on gpt2-tiny (in process and as `python -m graphtrain`), help, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from graphtrain.cli.main import SUBCOMMANDS, main
from graphtrain.config.sections import Config
from graphtrain.config.torch_compat import torchrun_shutdown_timeout_flag
from graphtrain.trainer import checkpoint as ck

TINY = [
    "model.name=gpt2-tiny",
    "data.seq_len=32",
    "data.vocab_size=512",
    "data.max_bytes=300000",
    "train.batch_size=4",
    "train.steps=4",
    "train.eval_every=2",
    "train.eval_batches=2",
    "train.log_every=2",
    "train.ckpt_every=2",
    "train.progress=false",
    "train.threads=1",
    "train.sample_tokens=8",
]


@pytest.fixture(autouse=True)
def tiny_env(tmp_path_factory, monkeypatch):
    cache = tmp_path_factory.getbasetemp() / "graphtrain-cache"  # shared with test_trainer: one tokenizer
    cache.mkdir(exist_ok=True)
    monkeypatch.setenv("GRAPHTRAIN_CACHE", str(cache))
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_train_end_to_end_then_resume(tmp_path, capsys):
    out_dir = tmp_path / "run"
    code, out, err = run(capsys, "train", *TINY, "--no-accelerate", "--out", str(out_dir))
    assert code == 0, err
    assert out.startswith("graphtrain: gpt2-tiny") and "config.yaml" in out  # a short banner; the config: a file
    assert "model:\n  name: gpt2-tiny" in (out_dir / "config.yaml").read_text() and "model:\n" not in out
    assert "val loss" in out and "tok/s" in out
    assert "completion of 'def '" in out
    assert [s for s, _ in ck.list_checkpoints(out_dir)] == [2, 4]

    code, out, err = run(capsys, "train", *TINY, "--no-accelerate", "--out", str(out_dir), "--resume", "--steps", "6")
    assert code == 0, err
    assert "resumed from" in out and "done: 6 steps" in out
    assert [s for s, _ in ck.list_checkpoints(out_dir)] == [2, 4, 6]
    sessions = json.loads((out_dir / "run.json").read_text())["sessions"]  # one per start, the resume appended
    assert [(s["resumed_at_step"], s["steps_done"]) for s in sessions] == [(0, 4), (4, 6)]


def test_yaml_config_as_subprocess(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("model: {name: gpt2-tiny}\ntrain: {seed: 7}\noptim: {lr: 0.002}\n")
    env = {**os.environ, "GRAPHTRAIN_CACHE": os.environ["GRAPHTRAIN_CACHE"]}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "graphtrain",
            "train",
            str(job),
            *TINY[1:],
            "train.steps=2",
            "--no-accelerate",
            "--out",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "done: 2 steps" in proc.stdout
    saved = Config.from_yaml(tmp_path / "run" / "config.yaml")
    assert (saved.train.seed, saved.optim.lr, saved.train.steps) == (7, 0.002, 2)  # YAML, then overrides
    assert [s for s, _ in ck.list_checkpoints(tmp_path / "run")] == [2]


def test_help_and_config_listing(capsys):
    code, out, _ = run(capsys, "train", "--help")
    assert code == 0
    for flag in ("--resume", "--resume-from", "--no-accelerate", "--out", "--steps", "--debug", "graphtrain config"):
        assert flag in out
    code, out, _ = run(capsys, "config")
    assert code == 0
    assert "train.steps = 400" in out and "Optimizer steps to run in total." in out
    assert "engine.precision" in out and "data.max_bytes" in out
    code, out, _ = run(capsys, "config", "train.steps=7")
    assert code == 0 and "steps: 7" in out
    assert run(capsys)[0] == 2  # no subcommand: usage
    assert {"train", "config"} <= set(SUBCOMMANDS)


def _fake_checkpoint(out_dir, model_name: str) -> None:
    config = Config().with_overrides([*TINY, f"model.name={model_name}"])
    ck.save_checkpoint(
        ck.checkpoint_path(out_dir, 2),
        {
            "format_version": ck.FORMAT_VERSION,
            "step": 2,
            "model": {},
            "optimizer": {},
            "rng": ck.rng_state(),
            "config": config.to_dict(),
        },
    )


BAD_INPUTS = {
    "unknown key": (["train.stepz=3"], "unknown config key 'train.stepz' (did you mean 'train.steps'?)"),
    "unknown section": (["trian.steps=3"], "'trian' is not a section"),
    "wrong type": (["train.steps=many"], "train.steps must be an integer"),
    "bad literal": (["optim.schedule=cosin"], "optim.schedule must be one of"),
    "not an override": (["train.steps"], "does not exist"),  # taken as a CONFIG.yaml path
    "missing config file": (["nope.yaml"], "config file 'nope.yaml' does not exist"),
    "missing data folder": (
        ["data.path=/nonexistent/graphtrain-data"],
        "data.path '/nonexistent/graphtrain-data' does not exist",
    ),
    "seq_len too long": (["data.seq_len=128"], "data.seq_len=128 is longer than model 'gpt2-tiny' supports"),
    "resume without checkpoint": (["--resume"], "no checkpoint"),
    "nproc without layout": (["--nproc=2"], "--nproc 2 but parallel.dp*tp*pp = 1: set parallel.dp=2"),
}


def test_nproc_passes_the_command_on_to_torchrun(monkeypatch, tmp_path):
    import graphtrain.distributed.launch as launch

    seen = {}
    monkeypatch.setattr(launch, "launch", lambda n, argv, **kw: seen.update(n=n, argv=argv, **kw) or 0)
    o = str(tmp_path / "o")
    assert main(["train", "job.yaml", "parallel.dp=2", "--nproc", "2", "--out", o, "--no-accelerate"]) == 2  # no yaml
    code = main(["train", *TINY, "parallel.dp=2", "--nproc", "2", "--out", o, "--resume", "--no-accelerate"])
    assert code == 0 and seen["n"] == 2 and seen["max_restarts"] == 0
    assert seen["argv"] == [*TINY, "parallel.dp=2", "--out", o, "--resume", "--no-accelerate"]
    assert seen["shutdown_timeout_s"] == 30 + 15  # train.preempt_grace_s plus the workers' exit margin
    assert "--nproc" not in launch.torchrun_command(2, seen["argv"])[3:]
    # --max-restarts: torchrun's elastic agent, also for one process; --resume auto and the allowed changes pass on
    code = main(
        [
            "train",
            *TINY,
            "--max-restarts",
            "3",
            "--out",
            o,
            "--resume",
            "auto",
            "--allow-config-change",
            "train.steps",
            "train.preempt_grace_s=5",
        ]
    )
    assert code == 0 and seen["n"] == 1 and seen["max_restarts"] == 3 and seen["shutdown_timeout_s"] == 20
    assert seen["argv"][-6:] == ["--out", o, "--allow-config-change", "train.steps", "--resume", "auto"]
    cmd = launch.torchrun_command(1, seen["argv"], max_restarts=3, shutdown_timeout_s=20)
    assert "--max-restarts=3" in cmd
    # torch 2.11's torchrun has no such option (and its agent waits a fixed 30 s): the flag is left out there
    assert ("--shutdown-timeout=20" in cmd) == (torchrun_shutdown_timeout_flag() is not None)


def test_a_torchrun_worker_exits_with_its_status_after_atexit_without_teardown():
    # program() skips interpreter teardown in torchrun workers (a gloo abort at exit), but not the atexit
    # handlers (the background compile's) or the exit status.
    code = (
        "import atexit, sys, torch.distributed; atexit.register(lambda: print('atexit ran', flush=True)); "
        "sys.argv = ['graphtrain'] + sys.argv[1:]; from graphtrain.cli.main import program; program()"
    )
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "t"}
    r = subprocess.run(
        [sys.executable, "-c", code, "config", "no.such=1"], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2 and "no.such" in r.stderr, r.stderr
    assert r.stdout.rstrip().endswith("atexit ran"), r.stdout[-300:]


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_exits_2_with_one_line(case, tmp_path, capsys):
    extra, expected = BAD_INPUTS[case]
    args = [a for a in extra if a.startswith("--")]
    items = [a for a in extra if not a.startswith("--")]
    if items and "=" not in items[0]:  # a CONFIG.yaml path goes first
        items = [items[0], *TINY]
    else:
        items = [*TINY, *items]
    code, out, err = run(capsys, "train", *items, "--no-accelerate", "--out", str(tmp_path / "run"), *args)
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert expected in err
    assert "Traceback" not in err + out


def test_empty_data_folder(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code, _, err = run(capsys, "train", *TINY, f"data.path={tmp_path / 'empty'}", "--out", str(tmp_path / "run"))
    assert code == 2 and err.startswith("error: ") and "data.path" in err and "Traceback" not in err


@pytest.mark.parametrize("damage", ["corrupt", "mismatched"])
def test_bad_checkpoint_exits_2(damage, tmp_path, capsys):
    out_dir = tmp_path / "run"
    if damage == "corrupt":
        out_dir.mkdir()
        (out_dir / "ckpt-0000002.pt").write_bytes(b"\x00" * 100)
        expected = "none of the 1 checkpoints in"  # each named on the line before, with its reason
    else:
        _fake_checkpoint(out_dir, "gpt2-mini")
        expected = "model.name: checkpoint 'gpt2-mini', current 'gpt2-tiny'"
    code, out, err = run(capsys, "train", *TINY, "--no-accelerate", "--out", str(out_dir), "--resume")
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and expected in err, err
    if damage == "corrupt":
        assert "ckpt-0000002.pt: it is corrupt" in out
    code, _, err = run(capsys, "train", *TINY, "--no-accelerate", "--out", str(out_dir))  # no --resume
    assert code == 2 and "already holds checkpoints" in err and "--resume" in err
    assert [s for s, _ in ck.list_checkpoints(out_dir)] == [2]  # untouched


def test_debug_shows_traceback(tmp_path):
    with pytest.raises(ValueError, match="unknown config key"):
        main(["train", *TINY, "train.stepz=1", "--debug"])
    with pytest.raises(ValueError, match="unknown config key"):
        main(["--debug", "train", *TINY, "train.stepz=1"])


def test_report_prints_what_the_engine_did(capsys):
    code, out, err = run(capsys, "report", *TINY, "engine.provider=aten")
    assert code == 0, err
    assert (
        "graphs captured: 3" in out and "compiled block by block: blocks (2 x Block)" in out
    )  # embeddings, block, head
    assert "fuse_bias_dropout_add" in out and "predicted step peak" in out
    code, out, err = run(capsys, "report", *TINY, "engine.provider=aten", "--json")
    assert code == 0 and '"graphs"' in out, err


def test_resume_takes_auto_and_leaves_other_arguments_alone(tmp_path, capsys):
    """`--resume` takes an optional `auto`; an item right after it (a YAML path or an override) stays an item."""
    out = str(tmp_path / "run")
    code, _, err = run(capsys, "train", "--resume", "train.steps=3", *TINY, "--no-accelerate", "--out", out)
    assert code == 2 and "no checkpoint" in err  # --resume alone: the latest checkpoint
    code, _, err = run(capsys, "train", "--resume", str(tmp_path / "job.yaml"), *TINY, "--out", out)
    assert code == 2 and "job.yaml' does not exist" in err  # the YAML path stayed the job file


def test_train_measures_the_matmul_peak_of_the_device_it_trains_on(monkeypatch, tmp_path):
    """MFU's denominator is measured once per machine for the device the Trainer picks: on a GPU machine the GPU's
    (the Trainer then looks up matmul_peak_cuda), not the CPU's. A run with only the jsonl logger measures none."""
    from graphtrain.kernels import flops
    from graphtrain.trainer import runtime

    seen = []

    class Stop(Exception):
        pass

    def measured(device="cpu", log=print):
        seen.append(device)
        raise Stop

    monkeypatch.setattr(flops, "ensure_machine_peak", measured)
    monkeypatch.setattr(runtime, "pick_device", lambda: torch.device("cuda"))
    with pytest.raises(Stop):
        main(["train", *TINY, "train.loggers=[jsonl,tensorboard]", "--out", str(tmp_path / "a"), "--debug"])
    assert seen == ["cuda"]
    monkeypatch.setattr(runtime, "pick_device", lambda: torch.device("cpu"))
    with pytest.raises(Stop):
        main(["train", *TINY, "train.loggers=[jsonl,tensorboard]", "--out", str(tmp_path / "b"), "--debug"])
    assert seen == ["cuda", "cpu"]
