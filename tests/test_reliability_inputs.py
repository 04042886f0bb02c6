"""A careful user's surprises (issue #50, item 6), each with the real fault: a real `~`, a run folder inside the data,
a planted pickle in the pass cache, a symlinked metrics.jsonl, a large file under data.max_bytes, a real SIGTERM
during data preparation, and the mistakes that used to end in tracebacks. docs/design/reliability.md lists each case with
its test."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from graphtrain.cli.main import main

TINY = [
    "model.name=gpt2-tiny",
    "data.seq_len=32",
    "data.vocab_size=512",
    "data.max_bytes=300000",
    "train.batch_size=4",
    "train.steps=2",
    "train.eval_every=0",
    "train.eval_batches=1",
    "train.log_every=1",
    "train.ckpt_every=1",
    "train.progress=false",
    "train.threads=1",
    "train.sample_tokens=0",
    "train.loggers=[jsonl]",
    "--no-accelerate",
]

pytestmark = pytest.mark.usefixtures("tiny_env")  # conftest.py: shared data cache, settings restored


def _code(n: int) -> str:
    return "".join(f"def f{i}(x):\n    return x * {i} + {n}\n\n" for i in range(400))


def _error_line(capsys) -> str:
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    return lines[0]


# ------------------------------------------------------------------------------------ (a) `~` ----


def test_tilde_in_out_dir_is_the_home_folder(tmp_path, monkeypatch):
    """train.out_dir=~/runs/x writes under $HOME, not into a folder named `~` in the working directory."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    assert main(["train", *TINY, "train.out_dir=~/runs/x"]) == 0
    assert (home / "runs" / "x" / "ckpt-0000002.pt").is_file()
    assert (home / "runs" / "x" / "metrics.jsonl").is_file()
    assert not (cwd / "~").exists()


def test_a_run_saved_with_an_unexpanded_tilde_resumes(tmp_path, monkeypatch, capsys):
    """A checkpoint whose config says data.path=~/data (saved before `~` was expanded when a config is made) resumes
    with the same command: ~/data and its expansion are the same folder, not a config change."""
    import torch as _torch

    from graphtrain.checksums import sha256_file, sidecar_path, write_sums

    home = tmp_path / "home"
    (home / "data").mkdir(parents=True)
    (home / "data" / "a.py").write_text(_code(1))
    (home / "data" / "b.py").write_text(_code(2))
    monkeypatch.setenv("HOME", str(home))
    args = [*TINY, "data.path=~/data", f"data.cache_dir={tmp_path / 'cache'}", "--out", str(tmp_path / "run")]
    assert main(["train", *args]) == 0
    ckpt = tmp_path / "run" / "ckpt-0000002.pt"
    state = _torch.load(ckpt, weights_only=True)
    state["config"]["data"]["path"] = "~/data"  # as the checkpoints of earlier graphtrain versions hold it
    _torch.save(state, ckpt)
    write_sums(sidecar_path(ckpt), [(ckpt.name, sha256_file(ckpt))])
    assert main(["train", *args, "--resume", "auto", "--steps", "3"]) == 0, capsys.readouterr().err


# ------------------------------------------------------------------------ (b) run inside data ----


def test_a_run_folder_inside_data_path_is_not_read_as_data(tmp_path, capsys):
    """The run writes its checkpoints and metrics inside data.path; resuming it reads the same corpus (the run's own
    files are not data), so `--resume auto` continues instead of being refused as "another tokenizer"."""
    data = tmp_path / "data"
    data.mkdir()
    for i in range(3):
        (data / f"m{i}.py").write_text(_code(i))
    args = [*TINY, f"data.path={data}", f"data.cache_dir={tmp_path / 'cache'}", "--out", str(data / "run")]
    assert main(["train", *args]) == 0
    assert main(["train", *args, "--resume", "auto", "--steps", "3"]) == 0, capsys.readouterr().err
    records = [json.loads(line) for line in (data / "run" / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in records) == 3
    from graphtrain.config.sections import Config
    from graphtrain.data.corpus import list_files

    _, files = list_files(Config().with_overrides([f"data.path={data}"]).data)
    assert sorted(f.relpath for f in files) == ["m0.py", "m1.py", "m2.py"]


# ------------------------------------------------------------------- (c) planted pass cache ----


class _Payload:
    """What a planted pickle runs when it is loaded: it creates a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _accelerated_step(cache: Path) -> object:
    import graphtrain
    from graphtrain.config.sections import ModelConfig
    from graphtrain.models import build_model

    torch.manual_seed(0)
    model = graphtrain.accelerate(
        build_model(ModelConfig(name="gpt2-tiny", dropout=0.0)), provider="aten", cache_dir=str(cache), fallback="error"
    )
    x = torch.randint(0, 512, (2, 16))
    model(x, x).backward()
    torch._dynamo.reset()
    return model._graphtrain


def test_a_planted_pass_cache_entry_runs_no_code(tmp_path, one_thread):
    """engine.cache_dir can name any folder: a pickle planted in its passes/ (raw, or with a forged header) is never
    loaded; the graph is traced again, the entry rewritten, and a genuine entry still hits."""
    import pickle

    forged = b"graphtrain-pass-cache-hmac-sha256\n" + b"\0" * 32  # pipeline/cache.py's header, with a made-up tag
    cache = tmp_path / "cache"
    _accelerated_step(cache)
    entries = sorted((cache / "passes").glob("*.pkl"))
    assert entries
    markers = []
    for i, path in enumerate(entries):
        markers.append(tmp_path / f"ran-{i}")
        payload = pickle.dumps(_Payload(markers[-1]))
        path.write_bytes(payload if i % 2 == 0 else forged + payload)
    state = _accelerated_step(cache)
    assert not any(m.exists() for m in markers), "a planted pickle ran"
    assert {g.pass_cache for g in state.graphs if g.pass_cache} == {"miss"}
    state = _accelerated_step(cache)  # the rewritten entries are genuine: they load
    assert {g.pass_cache for g in state.graphs if g.pass_cache} == {"hit"}


# ------------------------------------------------------------------- (d) symlinked metrics ----


def test_a_symlinked_metrics_log_is_refused_and_its_target_untouched(tmp_path, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to(victim)
    assert main(["train", *TINY, "--out", str(run)]) == 2
    line = _error_line(capsys)
    assert "metrics.jsonl" in line and "symbolic link" in line and "remove the link" in line
    assert victim.read_text() == "precious\n"


def test_a_symlink_planted_as_the_metrics_temporary_file_is_not_written_through(tmp_path, capsys):
    """On resume metrics.jsonl is rewritten through metrics.jsonl.tmp: a link planted there is replaced."""
    from graphtrain.trainer.metrics import MetricsLog

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.reset()
    for step in (1, 2, 3):
        log.write("train", step, loss=1.0)
    (tmp_path / "metrics.jsonl.tmp").symlink_to(victim)
    log.truncate_after(2)
    assert victim.read_text() == "precious\n"
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_resume_over_a_malformed_metrics_record_continues(tmp_path, capsys):
    """A metrics.jsonl line that is JSON but not a record (a list) is dropped with the records past the resumed
    step, as a torn line is (was: an AttributeError traceback at every --resume)."""
    run = tmp_path / "run"
    assert main(["train", *TINY, "--out", str(run)]) == 0
    with open(run / "metrics.jsonl", "a") as f:
        f.write("[1, 2]\n")
    assert main(["train", *TINY, "--out", str(run), "--resume", "auto", "--steps", "3"]) == 0, capsys.readouterr().err
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(isinstance(r, dict) for r in records) and max(r["step"] for r in records) == 3


# ------------------------------------------------------------------------ (e) max_bytes reads ----


def test_a_large_file_is_read_only_up_to_max_bytes(tmp_path):
    """data.max_bytes=20000 over a 64 MB text file: the read allocates about 20 KB, not the file (tracemalloc)."""
    import tracemalloc

    from graphtrain.config.sections import Config
    from graphtrain.data.corpus import list_files, read_files

    data = tmp_path / "data"
    data.mkdir()
    with open(data / "big.py", "wb") as f:
        line = "x = 'é' * 3  # a multi-byte character, cut or not\n".encode()
        f.write(line * (64 * 2**20 // len(line)))
    cfg = Config().with_overrides([f"data.path={data}", "data.max_bytes=20000"]).data
    _, files = list_files(cfg)
    tracemalloc.start()
    try:
        docs = read_files(files, cfg.max_bytes)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    text = docs["big.py"]
    assert len(text.encode()) <= 20000 and text.startswith("x = 'é'")
    assert peak < 1 * 2**20, f"reading 20 KB of a 64 MB file peaked at {peak / 2**20:.1f} MiB"


# --------------------------------------------------------------- (f) SIGTERM in data preparation ----


def test_sigterm_during_data_preparation_exits_75_and_says_nothing_was_lost(tmp_path):
    """A real SIGTERM while the tokenizer trains on a cold data cache (8 MB of the standard library, several
    seconds): exit 75 with one line saying nothing was lost; nothing of a run is written. The signal follows the
    cache folder's creation (data preparation has begun), so the test does not depend on the machine's speed."""
    env = dict(os.environ)
    args = [a for a in TINY if not a.startswith(("data.vocab_size", "data.max_bytes"))]
    cache = tmp_path / "cache"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "graphtrain",
            "train",
            *args,
            "data.vocab_size=2048",
            "data.max_bytes=8000000",
            f"data.cache_dir={cache}",
            "--out",
            str(tmp_path / "run"),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None and not cache.is_dir():  # data preparation began
        time.sleep(0.02)
    time.sleep(0.3)
    assert proc.poll() is None, "the run ended before the signal: the test would prove nothing"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-2000:]
    assert "preempted: SIGTERM before the first step" in err and "nothing was lost" in err
    assert "Traceback" not in err
    assert not list((tmp_path / "run").glob("ckpt-*"))


def test_sigterm_while_torch_is_imported_exits_75(tmp_path):
    """SIGTERM before data preparation, while `graphtrain train` imports torch: the same exit 75 and line
    (the handler is installed on the command's first line; a CI run once signalled before the trainer's)."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "graphtrain",
            "train",
            *TINY,
            f"data.cache_dir={tmp_path / 'c'}",
            "--out",
            str(tmp_path / "run"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if "libtorch" in Path(f"/proc/{proc.pid}/maps").read_text():
            break
        time.sleep(0.005)
    assert proc.poll() is None and not (tmp_path / "c").exists(), "torch was imported too late for the test"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, err[-2000:]
    assert "preempted: SIGTERM before the first step" in err and "Traceback" not in err


# ------------------------------------------------------------ (g) mistakes that were tracebacks ----


def _prepare_mistake(case: str, tmp: Path, monkeypatch) -> list[str]:
    """The files a case needs; returns the command (after `graphtrain`)."""
    import numpy as np

    if case == "model vocabulary smaller than the tokenizer's":
        return ["train", *TINY, "model.vocab_size=300", "--out", str(tmp / "run")]
    if case == "negative token ids":
        ids = np.arange(4000, dtype=np.int32) % 500
        ids[100] = -3
        np.save(tmp / "tokens.npy", ids)
        return ["train", *TINY, f"data.path={tmp / 'tokens.npy'}", "--out", str(tmp / "run")]
    if case == "absurd model.vocab_size":
        return ["train", *TINY, "model.vocab_size=100000000000", "--out", str(tmp / "run")]
    if case == "logger package missing":
        monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError, as when not installed
        return ["train", *TINY, "train.loggers=[jsonl,wandb]", "--out", str(tmp / "run")]
    if case == "exporter package missing":
        assert main(["train", *TINY, "--out", str(tmp / "run")]) == 0
        monkeypatch.setitem(sys.modules, "onnxruntime", None)
        return ["export", str(tmp / "run"), "--format", "onnx"]
    if case == "bad YAML in a sweep file":
        (tmp / "sweep.yaml").write_text("space: {optim.lr: [1\n")
        return ["sweep", str(tmp / "sweep.yaml")]
    if case in ("bad YAML in a run's config.yaml given to plot", "malformed metrics.jsonl record"):
        (tmp / "run").mkdir()
        (tmp / "run" / "metrics.jsonl").write_text(
            '{"kind": "train", "step": 1, "loss": 2.0}\n[1, 2]\n'
            if case.startswith("malformed")
            else '{"kind": "train", "step": 1, "loss": 2.0}\n'
        )
        (tmp / "run" / "config.yaml").write_text("model: {name: [gpt2\n" if case.startswith("bad") else "{}\n")
        return ["plot", str(tmp / "run"), "--out", str(tmp / "report.html")]
    if case == "deeply nested YAML":
        (tmp / "deep.yaml").write_text("train: " + "[" * 100_000 + "]" * 100_000 + "\n")
        return ["train", str(tmp / "deep.yaml"), *TINY, "--out", str(tmp / "run")]
    if case in ("data.cache_dir is a file", "engine.cache_dir is a file"):
        (tmp / "afile").write_text("x\n")
        args = [a for a in TINY if a != "--no-accelerate"] if case.startswith("engine") else TINY
        return ["train", *args, f"{case.split()[0]}={tmp / 'afile'}", "--out", str(tmp / "run")]
    if case == "deeply nested override":
        return ["train", *TINY, "train.loggers=" + "[" * 100_000 + "]" * 100_000, "--out", str(tmp / "run")]
    raise AssertionError(case)


MISTAKES = {  # case: (exit status, text the one error line holds: the key or file, and the fix)
    "model vocabulary smaller than the tokenizer's": (
        2,
        "model.vocab_size=300 is smaller than the tokenizer's "
        "vocabulary (512 ids): set model.vocab_size to at least 512",
    ),
    "negative token ids": (2, "tokens.npy' holds token id -3: token ids are 0 or more"),
    "absurd model.vocab_size": (2, "model.vocab_size=100000000000 is out of range: give 1 to 16,777,216"),
    "logger package missing": (2, "train.loggers asks for wandb, which is not installed: pip install wandb, or drop"),
    "exporter package missing": (2, "export --format onnx needs onnxruntime (not installed): pip install"),
    "bad YAML in a sweep file": (2, "sweep.yaml' is not valid YAML at line 2, column 1"),
    "bad YAML in a run's config.yaml given to plot": (2, "config.yaml' is not valid YAML at line 2"),
    "malformed metrics.jsonl record": (2, "metrics.jsonl' line 2 is not a metrics record"),
    "deeply nested YAML": (2, "deep.yaml' is not valid YAML: it nests deeper than the YAML reader can follow"),
    "deeply nested override": (2, "override train.loggers: it nests deeper than the YAML reader can follow"),
    # an unusable cache folder: a usage error naming the key (was exit 1, "continue with --resume auto")
    "data.cache_dir is a file": (
        2,
        "data.cache_dir '{tmp}/afile' cannot be used as a cache folder (File exists): "
        "point data.cache_dir at a folder you can write",
    ),
    "engine.cache_dir is a file": (2, "engine.cache_dir '{tmp}/afile' cannot be used as the compile cache"),
}


@pytest.mark.parametrize("case", list(MISTAKES))
def test_a_mistake_is_one_error_line_not_a_traceback(case, tmp_path, capsys, monkeypatch):
    argv = _prepare_mistake(case, tmp_path, monkeypatch)
    capsys.readouterr()
    code = main(argv)
    line = _error_line(capsys)
    status, expected = MISTAKES[case]
    assert expected.replace("{tmp}", str(tmp_path)) in line, line
    # one readable line, not a pasted blob; measured without the temporary folder's name, whose length depends on
    # the runner (pytest-xdist's workers add a level to it)
    assert len(line.replace(str(tmp_path), "{tmp}")) < 360, line
    assert code == status


# ------------------------------------------------------- hostile JSON files the loaders read (same kind) ----

DEEP_JSON = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("content", [DEEP_JSON, "[1, 2]"])
def test_a_hostile_model_hf_config_is_one_error_line(tmp_path, capsys, content):
    """model.hf's config.json nested 100,000 deep (a RecursionError traceback) or not an object: one error line."""
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(content)
    assert main(["train", *TINY, f"model.hf={tmp_path / 'hf'}", "--out", str(tmp_path / "run")]) == 2
    line = _error_line(capsys)
    assert "config.json" in line and "model.hf" in line


@pytest.mark.parametrize("content", [DEEP_JSON, "[1, 2]"])
def test_a_hostile_tokenizer_config_is_ignored(tmp_path, capsys, content):
    """data.tokenizer's tokenizer_config.json nested 100,000 deep or not an object (RecursionError and AttributeError
    tracebacks): ignored, the special tokens are found by their usual names, and the run trains."""
    from graphtrain.config.sections import Config
    from graphtrain.data.tokenizer import load_or_build

    built = load_or_build(Config().with_overrides(["data.vocab_size=512", "data.max_bytes=300000"]).data)
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_bytes((built.cache_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tok" / "tokenizer_config.json").write_text(content)
    assert main(["train", *TINY, f"data.tokenizer={tmp_path / 'tok'}", "--out", str(tmp_path / "run")]) == 0, (
        capsys.readouterr().err
    )


def test_resume_over_metrics_records_of_the_wrong_types_continues(tmp_path, capsys):
    """metrics.jsonl lines whose step is a string, or nested 100,000 deep (TypeError and RecursionError tracebacks
    at every --resume): dropped as torn lines are."""
    run = tmp_path / "run"
    assert main(["train", *TINY, "--out", str(run)]) == 0
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": "7"}\n' + DEEP_JSON + "\n")
    assert main(["train", *TINY, "--out", str(run), "--resume", "auto", "--steps", "3"]) == 0, capsys.readouterr().err
    assert max(json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()) == 3


@pytest.mark.slow  # a real background Inductor compile of gpt2-tiny (~30 s on 2 cores)
def test_the_wait_for_the_compile_after_step_one_then_sigterm_during_it(tmp_path):
    """train.compile_wait=true on a cold compile cache: after step 1 the run waits for the background Inductor
    compile, says so, records it in metrics.jsonl, and the training graphs run the measured winner from step 2;
    a warm run loads its stored winner at the same point. A second run, signalled with a real SIGTERM during its wait, stops waiting, saves step 1 and exits 75. A third,
    under auto with 3 steps left, gives the compile up and trains on aten."""
    args = [
        a for a in TINY if not a.startswith(("--no-accelerate", "train.steps", "train.threads", "train.ckpt_every"))
    ]
    base = [
        sys.executable,
        "-m",
        "graphtrain",
        "train",
        *args,
        "train.steps=4",
        "train.ckpt_every=0",
        "train.compile_wait=true",
    ]

    def train(command: list[str], cache: str, out_dir: str) -> str:
        run = subprocess.run(
            [*command, f"engine.cache_dir={tmp_path / cache}", "--out", str(tmp_path / out_dir)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        out = run.stdout + run.stderr
        assert run.returncode == 0, out[-3000:]
        return out

    out = train(base, "c1", "a")
    assert (
        "step 1: compiling the step with Inductor" in out
        and "Inductor compiled, loaded and timed against aten in" in out
    ), out[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    waits = [r for r in rows if r["kind"] == "compile"]
    assert len(waits) == 1 and waits[0]["step"] == 1 and waits[0]["wait_s"] > 0 and waits[0]["cached"] is False
    assert "training graph(s) on" in out and "inductor" in out.split("training graph(s) on", 1)[1].split(",")[0]

    # warm: the stored winner loads after step 1, between the steps, and says so
    out = train(base, "c1", "w")
    assert "step 1: loaded the compiled step from the cache in" in out, out[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["cached"]) for r in rows if r["kind"] == "compile"] == [(1, True)]

    proc = subprocess.Popen(
        [*base, f"engine.cache_dir={tmp_path / 'c2'}", "--out", str(tmp_path / "b")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "compiling the step with Inductor" in line:
            time.sleep(1.0)
            proc.send_signal(signal.SIGTERM)
            break
    rest, _ = proc.communicate(timeout=300)
    text = "".join(lines) + rest
    assert proc.returncode == 75, text[-3000:]
    assert "Inductor compiled, loaded and timed against aten in" not in text and "Traceback" not in text
    assert sorted(p.name for p in (tmp_path / "b").glob("ckpt-*.pt")) == ["ckpt-0000001.pt"]  # step 1, saved

    # auto with fewer than 100 steps left gives the compile up: aten runs the job, and the run says why
    auto = [a if a != "train.compile_wait=true" else "train.compile_wait=auto" for a in base]
    out = train(auto, "c3", "c")
    assert "step 1: aten runs the remaining steps; train.compile_wait: 3 steps left" in out, out[-3000:]
    assert "Inductor compiled, loaded and timed against aten in" not in out and "training graph(s) on aten," in out, (
        out[-3000:]
    )
