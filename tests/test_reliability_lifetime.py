"""Runs that surprise no one (issue #50, items 5 and 6), each with the real fault: a real `graphtrain train` whose
background compile is looked for in /proc, real signals, real symlinks, real files; docs/design/reliability.md lists each
case with its test.

The runs with a background compile (provider auto on a cold cache) are slow-marked: each is a real training
process that imports torch and compiles (25-40 s on the shared 2-core machine)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

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
]
BACKGROUND = "graphtrain.runtime.background"


# ------------------------------------------------------------ item 5: no process left behind ----


def _processes_of(session: int, parent: int) -> dict[int, str]:
    """Every live process of the session `session` (the training command's: started with a session of its own) and
    every background compile whose training process was `parent`, wherever it runs (a detached one has its own
    session): pid -> command line."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            argv = [a.decode(errors="replace") for a in (entry / "cmdline").read_bytes().split(b"\0") if a]
            state = (entry / "stat").read_text().rpartition(")")[2].split()[0]
            sid = os.getsid(pid)
        except (OSError, ProcessLookupError):
            continue
        if state == "Z":
            continue
        ours = BACKGROUND in argv and str(parent) in argv[argv.index(BACKGROUND) :]
        if sid == session or ours:
            out[pid] = " ".join(argv)[:200]
    return out


def _train(out: Path, cache: Path, data_cache: Path, *extra: str, steps: int = 4) -> subprocess.Popen:
    """`graphtrain train` with provider auto on a cold compile cache (a background compile starts at step 2), in a
    session of its own, under the default engine.background_at_exit (the test suite's override removed)."""
    env = {k: v for k, v in os.environ.items() if k != "GRAPHTRAIN_BACKGROUND_AT_EXIT"}
    env["GRAPHTRAIN_CACHE"] = str(cache)
    args = [a for a in TINY if not a.startswith(("train.steps=", "train.ckpt_every="))]
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "graphtrain",
            "train",
            *args,
            f"train.steps={steps}",
            "train.ckpt_every=0",
            "train.loggers=[jsonl]",
            "train.compile_wait=false",  # train beside the compile, as these tests' lifetimes assume
            f"data.cache_dir={data_cache}",
            "--out",
            str(out),
            *extra,
        ],
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


class _Watch:
    """Polls /proc while the run goes on and keeps the pids of the background compiles it saw."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.seen = proc, set()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while self.proc.poll() is None:
            self.seen |= {pid for pid, cmd in _processes_of(self.proc.pid, self.proc.pid).items() if BACKGROUND in cmd}
            time.sleep(0.05)

    def wait_for_child(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.seen and time.monotonic() < deadline and self.proc.poll() is None:
            time.sleep(0.05)
        assert self.seen, "no background compile was started: the test would prove nothing"


def _left(proc: subprocess.Popen, wait_s: float = 0.0) -> dict[int, str]:
    """What of the run is still running, after waiting up to `wait_s` for it to go."""
    deadline = time.monotonic() + wait_s
    while True:
        left = _processes_of(proc.pid, proc.pid)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)


@pytest.mark.slow
def test_a_finished_run_leaves_no_process_behind(tmp_path):
    """The run returns (4 steps, long before its background compile is done): nothing of it is left, not the
    compile child, not its compile workers, not a compiler."""
    proc = _train(tmp_path / "run", tmp_path / "cache", tmp_path / "data")
    watch = _Watch(proc)
    out, _ = proc.communicate(timeout=600)
    watch.thread.join()
    assert proc.returncode == 0, out[-3000:]
    assert watch.seen, "no background compile was started: the test would prove nothing"
    assert _left(proc) == {}


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_or_ctrl_c_leaves_no_process_behind(tmp_path, sig):
    """SIGTERM to the run, or Ctrl-C (SIGINT to the terminal's process group): exit 75 and nothing left."""
    proc = _train(tmp_path / "run", tmp_path / "cache", tmp_path / "data", steps=400)
    watch = _Watch(proc)
    watch.wait_for_child()
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 75, out[-3000:]
    assert _left(proc) == {}


@pytest.mark.slow
def test_a_killed_run_takes_its_background_compile_with_it(tmp_path):
    """SIGKILL (the OOM killer, a scheduler past its grace): no exit handler runs; the kernel ends the compile child
    (PR_SET_PDEATHSIG) and its workers follow (they watch their parent)."""
    proc = _train(tmp_path / "run", tmp_path / "cache", tmp_path / "data", steps=400)
    watch = _Watch(proc)
    watch.wait_for_child()
    proc.kill()
    proc.communicate(timeout=60)
    assert _left(proc, wait_s=10.0) == {}


@pytest.mark.slow
def test_finishing_in_the_background_is_opt_in_listed_and_stopped(tmp_path):
    """engine.background_at_exit=finish: the compile goes on after the run, detached, named graphtrain-bg;
    `graphtrain cache list` shows it and `graphtrain cache stop` ends it."""
    proc = _train(tmp_path / "run", tmp_path / "cache", tmp_path / "data", "engine.background_at_exit=finish")
    watch = _Watch(proc)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    left = _left(proc)
    try:
        assert len(left) == 1, (left, out[-2000:])
        (pid,) = left
        assert "finishes after this process" in out and "graphtrain cache stop" in out
        assert Path(f"/proc/{pid}/comm").read_text().strip() == "graphtrain-bg"
        assert os.getsid(pid) == pid  # detached: a session of its own
        listed = subprocess.run(
            [sys.executable, "-m", "graphtrain", "cache", "list"], capture_output=True, text=True, timeout=120
        )
        assert f"pid {pid} " in listed.stdout and f"its run (pid {proc.pid}) exited" in listed.stdout, listed
        stopped = subprocess.run(
            [sys.executable, "-m", "graphtrain", "cache", "stop", str(pid)], capture_output=True, text=True, timeout=120
        )
        assert stopped.returncode == 0 and f"pid {pid}" in stopped.stdout, stopped
        assert _left(proc, wait_s=10.0) == {}
    finally:
        for pid in _left(proc):
            os.kill(pid, signal.SIGKILL)
    assert watch.seen


def test_cache_stop_refuses_a_pid_that_is_not_a_background_compile(capsys):
    """`graphtrain cache stop PID` never signals a process that is not one of this user's background compiles."""
    assert main(["cache", "stop", str(os.getpid())]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no background compile of yours has pid") and err.count("\n") == 1


# ------------------------------------------------ a sweep's trials end with the sweep (same kind) ----


def _sweep(tmp: Path) -> subprocess.Popen:
    """`graphtrain sweep` of long trials (400 eager steps each), in a session of its own."""
    (tmp / "job.yaml").write_text(
        "model: {name: gpt2-tiny}\n"
        f"data: {{seq_len: 32, vocab_size: 512, max_bytes: 300000, cache_dir: {tmp / 'data'}}}\n"
        "train: {steps: 400, batch_size: 4, eval_every: 0, eval_batches: 1, log_every: 50, ckpt_every: 0,\n"
        "        threads: 1, accelerate: false, loggers: [jsonl]}\n"
    )
    (tmp / "sweep.yaml").write_text(
        f"job: job.yaml\nspace:\n  optim.lr: {{log_uniform: [1.0e-4, 1.0e-2]}}\n"
        f"trials: 2\nparallel: 1\npruner: none\nout: {tmp / 'sweep'}\n"
    )
    return subprocess.Popen(
        [sys.executable, "-m", "graphtrain", "sweep", str(tmp / "sweep.yaml")],
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_for_trial(proc: subprocess.Popen, timeout: float = 240.0) -> None:
    """Until a trial (`graphtrain train`) runs in the sweep's session, and a moment more (its imports)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if any(" train " in cmd for cmd in _processes_of(proc.pid, proc.pid).values()):
            time.sleep(5.0)
            return
        time.sleep(0.1)
    raise AssertionError("no trial started: the test would prove nothing")


@pytest.mark.slow
def test_sigterm_to_a_sweep_stops_its_trials(tmp_path):
    """SIGTERM to the sweep process alone (as a scheduler sends it): each running trial is preempted too; the sweep
    exits 75 and nothing of it is left (was: the trials trained on, orphaned)."""
    proc = _sweep(tmp_path)
    _wait_for_trial(proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 75, out[-3000:]
    assert "preempted: the sweep stopped on SIGTERM" in out
    assert _left(proc) == {}


@pytest.mark.slow
def test_a_killed_sweep_preempts_its_trials(tmp_path):
    """SIGKILL to the sweep: the kernel sends each trial SIGTERM (PR_SET_PDEATHSIG); it saves and exits."""
    proc = _sweep(tmp_path)
    _wait_for_trial(proc)
    proc.kill()
    proc.communicate(timeout=60)
    assert _left(proc, wait_s=90.0) == {}


def test_cache_stop_removes_only_a_compile_folder(tmp_path):
    """A process whose command line looks like a background compile but names another folder is stopped, and that
    folder is kept: `graphtrain cache stop` removes only folders graphtrain made for its compiles."""
    from graphtrain.runtime import background

    keep = tmp_path / "important"
    keep.mkdir()
    (keep / "owner.json").write_text("{}")
    impostor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "-m", BACKGROUND, str(keep)])
    try:
        deadline = time.monotonic() + 10
        while impostor.pid not in {r["pid"] for r in background.running()} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert background.stop([impostor.pid], grace_s=5.0) == [impostor.pid]
        assert impostor.wait(10) is not None
        assert keep.is_dir() and (keep / "owner.json").is_file()
    finally:
        if impostor.poll() is None:
            impostor.kill()
