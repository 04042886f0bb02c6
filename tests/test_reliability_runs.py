"""Runs lose nothing and surprise no one (issue #50), each with a real fault: restarts under torchrun's agent that
respect a refusal, one run per folder (two real concurrent processes), an export that cannot delete the run, a
real file-size limit (RLIMIT_FSIZE) during a checkpoint save, and a checksum file copied from another checkpoint.
docs/design/reliability.md lists each fault, what the user sees and the test here."""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from graphtrain.cli.main import main
from graphtrain.config.sections import Config
from graphtrain.trainer import Trainer, list_checkpoints
from graphtrain.trainer.checkpoint import latest_valid_checkpoint, load_checkpoint, verify_checkpoint
from graphtrain.trainer.resume import lock_run_folder

TINY = [
    "model.name=gpt2-tiny",
    "data.seq_len=32",
    "data.vocab_size=512",
    "data.max_bytes=300000",
    "train.batch_size=4",
    "train.eval_every=0",
    "train.eval_batches=1",
    "train.log_every=1",
    "train.accelerate=false",
    "train.progress=false",
    "train.threads=1",
    "train.deterministic=true",
    "train.sample_tokens=0",
    "optim.warmup_steps=2",
    "train.loggers=[jsonl]",
]

pytestmark = pytest.mark.usefixtures("tiny_env")  # conftest.py: shared data cache, settings restored


def _cli(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-u", "-m", "graphtrain", "train", *TINY, "--out", str(out), *extra]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _run(argv: list[str], timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=_env(), **kwargs)


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under `folder` (but the lock file) with its size and mtime: what "nothing changed" compares."""
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != ".graphtrain.lock"
    }


def _tiny(out: Path, *overrides: str) -> Config:
    return Config().with_overrides([*TINY, f"train.out_dir={out}", *overrides])


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


# ---------------------------------------------------------------------- 1. restarts and refusals ----


def test_max_restarts_never_restarts_a_refused_command_into_a_finished_run(tmp_path):
    """A folder that holds a finished run, started again without --resume under --max-restarts: refused (exit 2) and
    not restarted into a `--resume auto` of that run (before: the restart trained it again and exited 0)."""
    out = tmp_path / "run"
    Trainer(_tiny(out, "train.steps=3")).fit()
    before = _snapshot(out)
    done = _run(_cli(out, "train.steps=3", "--max-restarts", "2"))
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "already holds checkpoints" in done.stderr and "resumed from" not in done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert _snapshot(out) == before  # nothing trained, written or truncated


@pytest.mark.slow  # a torchrun launch or a Hugging Face export: 25-35 s on the shared 2-core machine
def test_max_restarts_keeps_the_checkpoint_a_mistyped_resume_from_asked_for(tmp_path):
    """--resume-from with a typo is refused; before, the restart resumed from the newest checkpoint and pruning then
    deleted the very checkpoint the user meant (ckpt-2)."""
    out = tmp_path / "run"
    Trainer(_tiny(out, "train.steps=4", "train.ckpt_every=1")).fit()
    assert [s for s, _ in list_checkpoints(out)] == [2, 3, 4]
    before = _snapshot(out)
    done = _run(
        _cli(
            out,
            "train.steps=8",
            "train.ckpt_every=1",
            "--resume-from",
            str(out / "ckpt-000002.pt"),
            "--max-restarts",
            "1",
        )
    )
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "ckpt-000002.pt' does not exist" in done.stderr
    assert _snapshot(out) == before  # ckpt-0000002.pt is still there, nothing after it


@pytest.mark.slow  # a torchrun launch or a Hugging Face export: 25-35 s on the shared 2-core machine
def test_a_crash_before_the_first_save_restarts_from_the_checkpoint_asked_for(tmp_path):
    """A real crash (SIGKILL of the worker during its start-up) under --resume-from ckpt-2: the restart continues from
    ckpt-2 again, not from the newest checkpoint of the folder (ckpt-4, of the history the user left)."""
    out = tmp_path / "run"
    Trainer(_tiny(out, "train.steps=4", "train.ckpt_every=1")).fit()
    proc = subprocess.Popen(
        _cli(
            out,
            "train.steps=400",
            "train.ckpt_every=0",
            "--resume-from",
            str(out / "ckpt-0000002.pt"),
            "--max-restarts",
            "1",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(),
    )
    deadline = time.monotonic() + 60
    while not _children(proc.pid) and time.monotonic() < deadline:  # the agent starts the first worker...
        time.sleep(0.05)
    for child in _children(proc.pid):  # ...which dies while it imports, long before it reads a checkpoint
        os.kill(child, signal.SIGKILL)
    log = []
    for line in proc.stdout:
        log.append(line)
        if line.startswith("resumed from"):  # the restart: stop it (SIGTERM to the agent) once it has resumed
            proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    text = "".join(log)
    assert f"resumed from {out / 'ckpt-0000002.pt'} at step 2" in text, text[-3000:]
    assert sum(line.startswith(f"resumed from {out}") for line in log) == 1  # one attempt got that far: the restart


# -------------------------------------------------------------------- 2. export never deletes a run ----


@pytest.fixture
def finished_run(tmp_path):
    out = tmp_path / "runs" / "a"
    Trainer(_tiny(out, "train.steps=2")).fit()
    return out


@pytest.mark.parametrize("where", ["the run", "its parent", "a folder of its own", "a checkpoint", "user files"])
def test_export_force_never_deletes_a_run_or_foreign_files(finished_run, where, capsys):
    run = finished_run
    target = {
        "the run": run,
        "its parent": run.parent,
        "a folder of its own": run / "superseded-1-x",
        "a checkpoint": run / "ckpt-0000002.pt",
        "user files": run.parent / "notes",
    }[where]
    if where == "a folder of its own":
        shutil.copytree(run, target, ignore=shutil.ignore_patterns("superseded-*"))
    if where == "user files":
        target.mkdir()
        (target / "thesis.tex").write_text("years of work")
    before = _snapshot(run.parent)
    code = main(["export", str(run), "--format", "safetensors", "--out", str(target), "--force"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert _snapshot(run.parent) == before  # nothing deleted, nothing written
    assert latest_valid_checkpoint(run) == run / "ckpt-0000002.pt"


def test_export_force_replaces_an_earlier_export_only_once_the_new_one_is_complete(finished_run, capsys):
    run = finished_run
    assert main(["export", str(run), "--format", "safetensors"]) == 0
    first = run / "export-safetensors"
    assert main(["export", str(run), "--format", "safetensors"]) == 2  # not empty, no --force
    assert main(["export", str(run), "--format", "safetensors", "--force"]) == 0
    record = json.loads((first / "export.json").read_text())
    assert record["out"] == str(first) and record["file"] == str(first / "model.safetensors")
    assert sorted(p.name for p in first.iterdir()) == ["export.json", "model.safetensors"]
    assert not [p for p in run.iterdir() if p.name.startswith(".export-")]  # no temporary folder left
    assert latest_valid_checkpoint(run) == run / "ckpt-0000002.pt"


# ----------------------------------------------------------------------------- 3. one run per folder ----


def test_a_second_run_on_a_live_folder_is_refused_and_touches_nothing(tmp_path):
    """Two real processes on one --out: the second is refused (exit 2) naming the first's PID and start time, and
    removes nothing, not even what looks like a killed save's leftover (here: the live run's save in flight)."""
    out = tmp_path / "run"
    log = tmp_path / "first.log"  # a file, not a pipe: a pipe nobody reads would stall the run's logging
    with log.open("w") as sink:
        first = subprocess.Popen(
            _cli(out, "train.steps=100000", "train.ckpt_every=0"), stdout=sink, stderr=subprocess.STDOUT, env=_env()
        )
    try:
        deadline = time.monotonic() + 120
        while (
            not re.search(r"^step +2/", log.read_text(), re.M) and first.poll() is None and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert first.poll() is None, log.read_text()[-2000:]
        in_flight = out / ".ckpt-0000009.pt.x7k2.tmp"  # the name a live save writes under
        in_flight.write_bytes(b"a checkpoint being written")
        second = _run(_cli(out, "train.steps=3", "--resume", "auto"), timeout=120)
        assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-2000:]
        err = second.stderr.strip()
        assert len(err.splitlines()) == 1 and f"in use by another graphtrain run (PID {first.pid} on" in err, err
        assert re.search(r"started \d{4}-\d\d-\d\d \d\d:\d\d:\d\d", err), err
        assert in_flight.read_bytes() == b"a checkpoint being written"  # not taken for an orphan
        assert "resumed" not in second.stdout and "done:" not in second.stdout
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=120)
    assert first.returncode == 75
    steps = [
        r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"
    ]
    assert steps == list(range(1, len(steps) + 1))  # one run's records, each step once
    assert lock_run_folder(out) == out / ".graphtrain.lock"  # the kernel released it with its process


# -------------------------------------------------------------------- 4. a real disk error while saving ----


def _file_size_limit(limit: int):
    def apply():  # in the child, before exec: past `limit` bytes a write fails with EFBIG (SIGXFSZ ignored, as
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # CPython does at start-up anyway: a shell's ulimit -f too)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def test_a_real_file_size_limit_during_a_save_is_one_line_and_keeps_the_last_checkpoint(tmp_path):
    out = tmp_path / "run"
    Trainer(_tiny(out, "train.steps=2", "train.ckpt_every=1")).fit()
    good = out / "ckpt-0000002.pt"
    limit = good.stat().st_size // 2  # metrics.jsonl and config.yaml stay far below it
    done = _run(
        _cli(out, "train.steps=4", "train.ckpt_every=1", "--resume", "auto"), preexec_fn=_file_size_limit(limit)
    )
    err = done.stderr.strip()
    assert done.returncode == 1, err[-3000:]
    assert "Traceback" not in err and len(err.splitlines()) == 1, err[-3000:]
    assert err.startswith("error: could not write the checkpoint of step 3: File too large"), err
    assert f"{good}, is kept" in err, err
    assert [p.name for p in out.iterdir() if p.name.endswith(".tmp")] == []  # no temporary file left
    assert [s for s, _ in list_checkpoints(out)] == [1, 2]
    assert verify_checkpoint(good) and load_checkpoint(good)["step"] == 2


# ------------------------------------------------------------------- 5. a checksum file names its file ----


def test_a_checksum_file_copied_from_another_checkpoint_verifies_nothing(tmp_path):
    out = tmp_path / "run"
    Trainer(_tiny(out, "train.steps=2", "train.ckpt_every=1")).fit()
    one, two = out / "ckpt-0000001.pt", out / "ckpt-0000002.pt"
    data = bytearray(two.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a changed checkpoint...
    two.write_bytes(bytes(data))
    shutil.copy(out / "ckpt-0000001.pt.sha256", out / "ckpt-0000002.pt.sha256")  # ...with an intact one's checksums
    with pytest.raises(ValueError, match=r"ckpt-0000002.pt.sha256 describes ckpt-0000001.pt, not ckpt-0000002.pt"):
        verify_checkpoint(two)
    assert latest_valid_checkpoint(out) == one
    assert verify_checkpoint(one)  # a checksum file as graphtrain writes it (sha256sum format, its own name)


# ------------------------------------------------------- the next ones: arguments that name a path ----


def test_resume_from_another_folder_into_a_folder_with_checkpoints_is_refused(tmp_path, capsys):
    """--resume-from A/ckpt-2 --out B, B holding another history: refused, B's checkpoints kept (before: B's later
    ones moved aside and its ckpt-2 was pruned once the new history had saved three)."""
    a, b = tmp_path / "a", tmp_path / "b"
    Trainer(_tiny(a, "train.steps=4", "train.ckpt_every=1")).fit()
    Trainer(_tiny(b, "train.steps=4", "train.ckpt_every=1", "optim.lr=0.002")).fit()
    before = _snapshot(b)
    code = main(
        [
            "train",
            *TINY,
            "train.steps=6",
            "train.ckpt_every=1",
            "--out",
            str(b),
            "--resume-from",
            str(a / "ckpt-0000002.pt"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "holds checkpoints of its own (latest ckpt-0000004.pt)" in err, err
    assert _snapshot(b) == before
    # the same checkpoint continued in an empty folder, or within its own folder, still works
    assert (
        main(
            ["train", *TINY, "train.steps=5", "--out", str(tmp_path / "c"), "--resume-from", str(a / "ckpt-0000002.pt")]
        )
        == 0
    )


@pytest.mark.parametrize("name", ["config.yaml", "metrics.jsonl", "ckpt-0000002.pt", "."])
def test_plot_never_writes_its_page_over_a_run_file(finished_run, name, capsys):
    run = finished_run
    before = _snapshot(run)
    code = main(["plot", str(run), "--out", str(run / name)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: --out") and len(err.strip().splitlines()) == 1, err
    assert _snapshot(run) == before
    assert main(["plot", str(run), "--out", str(run.parent / "report.html")]) == 0


@pytest.mark.slow  # a torchrun launch or a Hugging Face export: 25-35 s on the shared 2-core machine
def test_an_export_killed_half_way_leaves_the_earlier_export_and_the_run_intact(finished_run):
    """SIGKILL of `export --format hf --force` while it writes (its temporary folder exists): the earlier export and
    the run are untouched, only the temporary folder is left; the same command then succeeds."""
    run = finished_run
    assert main(["export", str(run), "--format", "safetensors", "--out", str(run.parent / "e")]) == 0
    before, earlier = _snapshot(run), _snapshot(run.parent / "e")
    argv = [
        sys.executable,
        "-m",
        "graphtrain",
        "export",
        str(run),
        "--format",
        "hf",
        "--out",
        str(run.parent / "e"),
        "--force",
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    deadline = time.monotonic() + 120
    while (
        not [p for p in run.parent.iterdir() if p.name.startswith(".e.")]
        and proc.poll() is None
        and time.monotonic() < deadline
    ):
        time.sleep(0.002)
    proc.kill()
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert _snapshot(run) == before and _snapshot(run.parent / "e") == earlier
    left = [p for p in run.parent.iterdir() if p.name not in ("a", "e")]
    assert len(left) == 1 and re.fullmatch(r"\.e\..+\.tmp", left[0].name) and left[0].is_dir(), left
    done = _run(argv)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (run.parent / "e" / "config.json").is_file() and _snapshot(run) == before


def _small_disk_available() -> bool:
    """A tmpfs of our own, mounted in a user and mount namespace (`unshare -rm`): no root needed where the kernel
    lets users create namespaces."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"], capture_output=True, timeout=30
    )
    return probe.returncode == 0


@pytest.mark.slow  # two CLI runs in a namespace: 35 s on the shared 2-core machine
def test_a_real_full_disk_during_a_save_is_one_line_and_keeps_the_last_checkpoint(tmp_path):
    """The run folder on a real 4 MiB tmpfs: two checkpoints of gpt2-tiny (1.7 MB each) fit, the third does not
    (ENOSPC in torch.save). The tmpfs lives in the namespace only, so the script copies the folder out."""
    if not _small_disk_available():
        pytest.skip("needs `unshare -rm` (user namespaces) to mount a tmpfs")
    disk, copy = tmp_path / "disk", tmp_path / "copy"
    disk.mkdir()
    run = disk / "run"
    first = " ".join(_cli(run, "train.steps=2", "train.ckpt_every=1"))
    second = " ".join(_cli(run, "train.steps=4", "train.ckpt_every=1", "--resume", "auto"))
    script = (
        f"mount -t tmpfs -o size=4m tmpfs {disk} && {first} >/dev/null 2>&1 && {second} >/dev/null "
        f"2>{tmp_path / 'err'}; echo $? > {tmp_path / 'rc'}; cp -a {run} {copy}"
    )
    subprocess.run(["unshare", "-rm", "sh", "-c", script], timeout=600, env=_env(), check=True)
    err = (tmp_path / "err").read_text().strip()
    assert (tmp_path / "rc").read_text().strip() == "1", err[-3000:]
    assert "Traceback" not in err and len(err.splitlines()) == 1, err[-3000:]
    assert err.startswith("error: could not write the checkpoint of step 3: the disk is full"), err
    assert f"{run / 'ckpt-0000002.pt'}, is kept" in err, err
    assert [p.name for p in copy.iterdir() if p.name.endswith(".tmp")] == []
    assert [s for s, _ in list_checkpoints(copy)] == [1, 2]
    assert verify_checkpoint(copy / "ckpt-0000002.pt") and load_checkpoint(copy / "ckpt-0000002.pt")["step"] == 2


def test_a_symlink_planted_as_the_lock_file_is_refused_and_its_target_untouched(tmp_path, capsys):
    """The lock file is opened with O_NOFOLLOW: a symlink under its name never gets the holder's record written
    through it (the lock writer truncates the file it opens)."""
    out, victim = tmp_path / "run", tmp_path / "victim.txt"
    out.mkdir()
    victim.write_text("someone's file")
    (out / ".graphtrain.lock").symlink_to(victim)
    code = main(["train", *TINY, "train.steps=1", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "cannot open the run folder's lock file" in err and len(err.strip().splitlines()) == 1, err
    assert victim.read_text() == "someone's file" and sorted(p.name for p in out.iterdir()) == [".graphtrain.lock"]


def test_a_job_file_that_is_the_run_folders_config_yaml_is_never_overwritten(tmp_path, capsys):
    """`graphtrain train DIR/config.yaml --out DIR` with a job file the user wrote (comments, a few keys): refused
    before anything runs, the file untouched. A run's own saved config given back is exactly what the run writes,
    so it is taken."""
    out = tmp_path / "run"
    out.mkdir()
    job = out / "config.yaml"
    job.write_text("# my job: a tiny GPT-2\nmodel:\n  name: gpt2-tiny\ntrain:\n  steps: 2\n")
    before = job.read_text()
    code = main(["train", str(job), *TINY[1:], "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "is the run folder's config.yaml" in err and err.count("\n") == 1, err
    assert job.read_text() == before and not list_checkpoints(out)
    saved = tmp_path / "saved"
    assert main(["train", *TINY, "train.steps=2", "--out", str(saved)]) == 0
    assert main(["train", str(saved / "config.yaml"), "train.steps=3", "--out", str(saved), "--resume"]) == 0
