"""A quiet, honest console (issue #51 item 5): a short start banner (the full config is in the run folder), a
progress bar on a terminal and plain periodic lines in a log file (no carriage-return redraws), and exports that
print their own line, not other libraries' progress bars."""

from __future__ import annotations

import fcntl
import importlib.util
import os
import pty
import re
import struct
import subprocess
import sys
import termios

import pytest
import torch
import yaml

from graphtrain.trainer.console import human, human_bytes, human_seconds

TINY = [
    "model.name=gpt2-tiny",
    "data.seq_len=32",
    "data.vocab_size=512",
    "data.max_bytes=300000",
    "train.batch_size=2",
    "train.steps=4",
    "train.eval_every=2",
    "train.eval_batches=1",
    "train.log_every=1",
    "train.ckpt_every=0",
    "train.threads=1",
    "train.sample_tokens=0",
    "train.accelerate=false",
    "train.loggers=[jsonl]",
]


def _env(cache):
    return {**os.environ, "GRAPHTRAIN_CACHE": str(cache)}


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    """`graphtrain train` with stdout and stderr going to a file, as under nohup or a batch scheduler; with
    train.export_hf, whose transformers save and reload once drew their progress bars into the log."""
    hf = ["train.export_hf=true"] if importlib.util.find_spec("transformers") else []
    tmp = tmp_path_factory.mktemp("console")
    cache = tmp_path_factory.getbasetemp() / "graphtrain-cache"
    cache.mkdir(exist_ok=True)
    log = tmp / "train.log"
    with open(log, "w") as f:
        proc = subprocess.run(
            [sys.executable, "-m", "graphtrain", "train", *TINY, *hf, "--out", str(tmp / "run")],
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=600,
            env=_env(cache),
        )
    text = log.read_text()
    assert proc.returncode == 0, text
    assert not hf or (tmp / "run" / "hf" / "config.json").is_file()
    return tmp / "run", text, cache


def test_a_log_file_gets_plain_lines_and_no_redraws(logged_run):
    run, text, _ = logged_run
    assert "\r" not in text and "\x1b[" not in text, repr(text[:2000])
    steps = re.findall(
        r"^step +(\d+)/4 +loss [\d.]+ +lr \S+ +([\d.]+k?) tok/s +\d+ ms/step +peak mem [\d.]+ \w+"
        r"(  \(includes the first step: warm-up, capture, compile\))?$",
        text,
        re.M,
    )
    assert [(s, bool(first)) for s, _, first in steps] == [("1", True), ("2", False), ("3", False), ("4", False)], text
    assert not re.search(r"\de[+-]\d+ tok/s", text)


def test_run_json_says_where_when_and_from_what(logged_run):
    """run.json (trainer/runinfo.py) of the logged run, and the plot page's table reading it."""
    import json

    from graphtrain.runs.plot import load_run, run_facts

    run, _, _ = logged_run
    (session,) = json.loads((run / "run.json").read_text())["sessions"]
    assert session["started_unix"] < session["finished_unix"] and session["steps_done"] == 4
    assert session["resumed_at_step"] == 0 and session["provider"] == "eager" and session["tokens_per_step"] == 64
    assert session["host"] and session["cpu"] and session["torch"] == torch.__version__ and session["device"] == "cpu"
    assert session["commit"] is None or re.fullmatch(r"[0-9a-f]{40}( \(dirty\))?", session["commit"])
    facts = run_facts(load_run(run))
    assert facts["machine"] == f"{session['host']} / {session['cpu']}" and facts["tokens/step"] == "64"
    assert facts["duration"].endswith(" s") and facts["first step (capture + compile)"] != "n/a"


def test_the_banner_is_short_and_the_config_is_in_the_run_folder(logged_run):
    run, text, _ = logged_run
    lines = text.splitlines()
    banner = lines[: next(i for i, line in enumerate(lines) if line.startswith("step "))]
    assert 3 <= len(banner) <= 15, "\n".join(banner)
    head = "\n".join(banner)
    assert "gpt2-tiny" in head and "params" in head and "cpu" in head and str(run) in head and "config.yaml" in head
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["engine"]["loss_scale_hysteresis"] and "loss_scale_hysteresis" not in text  # not printed


def test_a_terminal_gets_the_progress_bar(tmp_path, logged_run):
    """The same command with stderr on a pseudo-terminal: tqdm's bar (carriage-return redraws), no plain lines."""
    _, _, cache = logged_run
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a 120-column terminal
    with open(tmp_path / "stdout.log", "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "graphtrain", "train", *TINY, "--out", str(tmp_path / "run")],
            stdout=out,
            stderr=follower,
            env=_env(cache),
        )
    os.close(follower)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    assert proc.wait(timeout=600) == 0, seen.decode(errors="replace")[-3000:]
    os.close(leader)
    bar = seen.decode(errors="replace")
    assert "\r" in bar and "4/4" in bar and ("step/s" in bar or "s/step" in bar), bar[-2000:]
    assert not re.search(r"^step +\d+/4 ", (tmp_path / "stdout.log").read_text(), re.M)


def test_export_prints_its_own_line_only(logged_run, tmp_path):
    run, _, cache = logged_run
    log = tmp_path / "export.log"
    with open(log, "w") as f:
        proc = subprocess.run(
            [sys.executable, "-m", "graphtrain", "export", str(run), "--format", "hf", "--out", str(tmp_path / "hf")],
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=600,
            env=_env(cache),
        )
    text = log.read_text()
    assert proc.returncode == 0, text
    assert "\r" not in text and "it/s" not in text and "Loading weights" not in text, text
    assert text.splitlines() == [line for line in text.splitlines() if line.startswith("exported ")], text


@pytest.mark.slow
def test_onnx_export_prints_its_own_line_only(logged_run, tmp_path):
    run, _, cache = logged_run
    proc = subprocess.run(
        [sys.executable, "-m", "graphtrain", "export", str(run), "--format", "onnx", "--out", str(tmp_path / "onnx")],
        capture_output=True,
        text=True,
        timeout=900,
        env=_env(cache),
    )
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout + proc.stderr
    assert "[torch.onnx]" not in text and "Skipping" not in text and "FutureWarning" not in text, text
    assert len(text.splitlines()) == 1 and text.startswith("exported "), text


def test_numbers_read_as_people_write_them():
    assert human(25012.3, "tok/s") == "25.0k tok/s" and human(2.501e4) == "25.0k" and human(1.53e9) == "1.5G"
    assert human(64) == "64" and human(12.34) == "12.3" and human(0.0004) == "0.0004" and human(None) == "n/a"
    assert human(float("nan")) == "n/a" and human(-2500.0) == "-2.5k"
    assert human_bytes(612429824) == "584.1 MiB" and human_bytes(512) == "512 B"
    assert human_seconds(12.34) == "12.3 s" and human_seconds(185) == "3 min 05 s"
    assert human_seconds(3725) == "1 h 02 min"
