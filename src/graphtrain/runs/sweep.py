"""``graphtrain sweep SWEEP.yaml``: a hyperparameter search with Optuna, poor trials stopped early.

A sweep file::

    job: gpt2-tiny-test.yaml            # the base job (relative to this file), optional
    config: {train.steps: 40}           # overrides on top of it, optional
    space:                              # any config key
      optim.lr: {log_uniform: [1.0e-4, 3.0e-2]}
      train.batch_size: {choices: [2, 4]}
      optim.warmup_steps: {int: [0, 10]}
      optim.weight_decay: {uniform: [0.0, 0.1]}
    trials: 8
    parallel: 2                         # trials run at once, each its own process
    sampler: tpe                        # tpe | random
    pruner: median                      # median | asha | none
    seed: 0
    out: runs/sweep-tiny                # one run directory per trial, the study, the summary

Each trial is a normal ``graphtrain train`` run in ``<out>/trial-<n>``. After each evaluation the trial reports its
validation loss to the study (Optuna's SQLite storage, ``<out>/study.db``, which also makes the sweep resumable:
the same command continues it) and stops when the pruner says so (its metrics.jsonl ends with a ``stopped``
record; the trial is PRUNED). The summary: a table of trials, ``best.yaml`` (the best trial's full job, ready for
``graphtrain train``), ``summary.json`` and ``report.html`` (graphtrain plot of the best runs).

``--trials N``, ``--parallel N`` and ``--out DIR`` on the command line (``run_sweep(..., trials=, parallel=, out=)``)
override the file's values. When the best trial's value of a numeric parameter lies at an edge of its range
(within `EDGE_FRACTION` of the range's width from it, measured in log space for log_uniform; the first or last of
three or more numeric choices), the optimum may lie outside the range: the summary says so with one warning per
parameter (``edge_warnings`` in summary.json) and the range to try next.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graphtrain.config.jobfile import read_yaml_file
from graphtrain.config.sections import Config, load_job_file
from graphtrain.runtime.background import die_with_parent

ENV_STORAGE, ENV_STUDY, ENV_TRIAL = "GRAPHTRAIN_SWEEP_STORAGE", "GRAPHTRAIN_SWEEP_STUDY", "GRAPHTRAIN_SWEEP_TRIAL"
ENV_PRUNER = "GRAPHTRAIN_SWEEP_PRUNER"  # "<name>:<startup trials>": Optuna's storage does not keep the pruner
ENV_SWEEP_PID = "GRAPHTRAIN_SWEEP_PID"  # the sweep process: a trial is preempted (SIGTERM) when it dies
DISTRIBUTIONS = ("log_uniform", "uniform", "int", "choices")
SAMPLERS = ("tpe", "random")
PRUNERS = ("median", "asha", "none")
KEYS = (
    "job",
    "config",
    "space",
    "trials",
    "parallel",
    "sampler",
    "pruner",
    "seed",
    "out",
    "metric",
    "direction",
    "startup_trials",
)
EDGE_FRACTION = 0.05  # a best value this close to an end of its range (a fraction of the width) is at the edge


@dataclass
class Sweep:
    path: Path
    base: Any  # the graphtrain Config every trial starts from
    space: dict[str, tuple[str, list[Any]]]
    trials: int = 8
    parallel: int = 1
    sampler: str = "tpe"
    pruner: str = "median"
    seed: int = 0
    out: Path = Path("runs/sweep")
    startup_trials: int = 2  # trials that finish before the pruner may stop one
    job_items: list[str] = field(default_factory=list)


def load_sweep(
    path: str | Path, *, trials: int | None = None, parallel: int | None = None, out: str | Path | None = None
) -> Sweep:
    """The sweep file, checked completely (every key of the space, every range) before any trial starts; `trials`,
    `parallel` and `out` (the command line's) replace the file's values."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"sweep file {str(path)!r} does not exist")
    d = (
        read_yaml_file(
            path, "sweep file", "fix the syntax there (job:, space:, trials:, ... as in configs/sweep-tiny.yaml)"
        )
        or {}
    )
    if not isinstance(d, dict):
        raise ValueError(f"sweep file {str(path)!r} must hold a mapping (job:, space:, trials:, ...)")
    unknown = sorted(set(d) - set(KEYS))
    if unknown:
        raise ValueError(f"sweep file {str(path)!r}: unknown key(s) {unknown}; a sweep file takes {list(KEYS)}")
    if d.get("metric", "val_loss") != "val_loss" or d.get("direction", "minimize") != "minimize":
        raise ValueError("a sweep minimizes the validation loss: metric must be val_loss, direction minimize")
    base = Config.from_dict(load_job_file(path.parent / d["job"])) if d.get("job") else Config()
    overrides = d.get("config") or {}
    if not isinstance(overrides, dict):
        raise ValueError("sweep config: must be a mapping of config keys to values, e.g. {train.steps: 40}")
    base = base.with_overrides({str(k): v for k, v in overrides.items()})
    space = d.get("space") or {}
    if not isinstance(space, dict) or not space:
        raise ValueError(
            "sweep space: name at least one config key and its range, e.g. optim.lr: {log_uniform: [1.0e-4, 1.0e-2]}"
        )
    parsed = {}
    for key, spec in space.items():
        parsed[str(key)] = _distribution(str(key), spec)
        kind, args = parsed[str(key)]
        for probe in args:  # each end of a range, each choice: a valid job
            try:
                base.with_overrides({str(key): int(probe) if kind == "int" else probe})
            except (ValueError, TypeError) as e:
                raise ValueError(f"sweep space {key}: {e}") from None
    sweep = Sweep(
        path=path,
        base=base,
        space=parsed,
        trials=_positive(d, "trials", 8),
        parallel=_positive(d, "parallel", 1),
        sampler=str(d.get("sampler", "tpe")),
        pruner=str(d.get("pruner", "median")),
        seed=int(d.get("seed", 0)),
        out=Path(d.get("out") or f"runs/sweep-{path.stem}"),
        startup_trials=int(d.get("startup_trials", 2)),
    )
    if sweep.sampler not in SAMPLERS:
        raise ValueError(f"sweep sampler {sweep.sampler!r} is unknown; choose from {list(SAMPLERS)}")
    if sweep.pruner not in PRUNERS:
        raise ValueError(f"sweep pruner {sweep.pruner!r} is unknown; choose from {list(PRUNERS)}")
    for name, value in (("trials", trials), ("parallel", parallel)):
        if value is not None:
            setattr(sweep, name, _positive({name: value}, name, 1))
    if out is not None:
        sweep.out = Path(out).expanduser()
    return sweep


def _positive(d: dict[str, Any], key: str, default: int) -> int:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"sweep {key} must be a positive integer, got {v!r}")
    return v


def _distribution(key: str, spec: Any) -> tuple[str, list[Any]]:
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in DISTRIBUTIONS:
        raise ValueError(
            f"sweep space {key}: give one of {list(DISTRIBUTIONS)}, e.g. {{log_uniform: [1.0e-4, "
            f"1.0e-2]}} or {{choices: [2, 4]}}; got {spec!r}"
        )
    kind, args = next(iter(spec.items()))
    if kind == "choices":
        if not isinstance(args, list) or not args:
            raise ValueError(f"sweep space {key}: choices must be a non-empty list")
        return kind, args
    if not (
        isinstance(args, list)
        and len(args) == 2
        and all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in args)
    ):
        raise ValueError(f"sweep space {key}: {kind} takes [low, high], two numbers; got {args!r}")
    low, high = args
    if low > high:
        raise ValueError(f"sweep space {key}: the range's low {low} is above its high {high}")
    if kind == "log_uniform" and low <= 0:
        raise ValueError(f"sweep space {key}: a log_uniform range must be positive, got low {low}")
    if kind == "int" and not all(float(a).is_integer() for a in args):
        raise ValueError(f"sweep space {key}: an int range takes integers, got {args!r}")
    return kind, [low, high]


def _suggest(trial: Any, key: str, kind: str, args: list[Any]) -> Any:
    if kind == "log_uniform":
        return trial.suggest_float(key, args[0], args[1], log=True)
    if kind == "uniform":
        return trial.suggest_float(key, args[0], args[1])
    if kind == "int":
        return trial.suggest_int(key, int(args[0]), int(args[1]))
    return trial.suggest_categorical(key, args)


def _study(sweep: Sweep) -> Any:
    import optuna

    sampler = (
        optuna.samplers.TPESampler(seed=sweep.seed, n_startup_trials=max(sweep.startup_trials, 1))
        if sweep.sampler == "tpe"
        else optuna.samplers.RandomSampler(seed=sweep.seed)
    )
    sweep.out.mkdir(parents=True, exist_ok=True)
    return optuna.create_study(
        storage=_storage(sweep),
        study_name="graphtrain",
        sampler=sampler,
        pruner=_pruner(sweep.pruner, sweep.startup_trials),
        direction="minimize",
        load_if_exists=True,
    )


def _pruner(name: str, startup_trials: int) -> Any:
    import optuna

    if name == "median":  # stop a trial whose loss is above the median of earlier trials' at the same step
        return optuna.pruners.MedianPruner(n_startup_trials=startup_trials, n_warmup_steps=0)
    if name == "asha":
        return optuna.pruners.SuccessiveHalvingPruner()
    return optuna.pruners.NopPruner()


def _storage(sweep: Sweep) -> str:
    return f"sqlite:///{(sweep.out / 'study.db').resolve()}"


def run_sweep(
    path: str | Path,
    *,
    summary_only: bool = False,
    trials: int | None = None,
    parallel: int | None = None,
    out: str | Path | None = None,
    log: Any = print,
) -> dict[str, Any]:
    """Run (or continue) the sweep, then write and return its summary; `trials`, `parallel`, `out` override the
    file's values (a sweep continued in the same `out` counts the trials it has run: `trials` is the total)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sweep = load_sweep(path, trials=trials, parallel=parallel, out=out)
    study = _study(sweep)
    if not summary_only:
        _run_trials(sweep, study, log)
    return write_summary(sweep, study, log)


def _run_trials(sweep: Sweep, study: Any, log: Any) -> None:
    import optuna

    threads = max(1, (os.cpu_count() or 1) // sweep.parallel)
    done = len([t for t in study.trials if t.state.is_finished()])
    for t in study.trials:  # a sweep stopped while trials ran: those trials are lost, count them failed
        if t.state == optuna.trial.TrialState.RUNNING:
            study.tell(t.number, state=optuna.trial.TrialState.FAIL)
    running: dict[int, tuple[Any, subprocess.Popen, Path]] = {}
    with _stop_trials_at_exit(running, sweep):
        _trial_loop(sweep, study, log, running, done, threads)


def _trial_loop(
    sweep: Sweep, study: Any, log: Any, running: dict[int, tuple[Any, subprocess.Popen, Path]], done: int, threads: int
) -> None:
    import optuna

    while done + len(running) < sweep.trials or running:
        while len(running) < sweep.parallel and done + len(running) < sweep.trials:
            trial = study.ask()
            params = {k: _suggest(trial, k, kind, args) for k, (kind, args) in sweep.space.items()}
            name = f"trial-{trial.number:03d}"
            run_dir = sweep.out / name
            job = sweep.base.with_overrides(
                {
                    **params,
                    "train.out_dir": str(run_dir),
                    "train.progress": False,
                    "train.threads": threads,
                    "train.sample_tokens": 0,
                }
            )
            (sweep.out / f"{name}.yaml").write_text(job.to_yaml())
            env = {
                **os.environ,
                ENV_STORAGE: _storage(sweep),
                ENV_STUDY: study.study_name,
                ENV_TRIAL: str(trial._trial_id),
                ENV_PRUNER: f"{sweep.pruner}:{sweep.startup_trials}",
                ENV_SWEEP_PID: str(os.getpid()),
            }
            logf = open(sweep.out / f"{name}.log", "w")  # noqa: SIM115 - closed when the trial ends
            proc = subprocess.Popen(
                [sys.executable, "-m", "graphtrain", "train", str(sweep.out / f"{name}.yaml")],
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=env,
            )
            proc.log_file = logf  # type: ignore[attr-defined]
            running[trial.number] = (trial, proc, run_dir)
            log(f"trial {trial.number}: {params}")
        time.sleep(0.2)
        for number, (trial, proc, run_dir) in list(running.items()):
            if proc.poll() is None:
                continue
            proc.log_file.close()  # type: ignore[attr-defined]
            del running[number]
            done += 1
            state, value = _outcome(proc.returncode, run_dir)
            if state == "complete":
                study.tell(trial, value)
            elif state == "pruned":
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            else:
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
            log(
                f"trial {number}: {state}"
                + (f", val loss {value:.4f}" if value is not None else "")
                + ("" if state != "failed" else f" (see {sweep.out / (run_dir.name + '.log')})")
            )


class _SweepPreempted(Exception):
    """SIGTERM to the sweep process."""


@contextlib.contextmanager
def _stop_trials_at_exit(running: dict[int, tuple[Any, subprocess.Popen, Path]], sweep: Sweep) -> Iterator[None]:
    """No trial outlives its sweep. On SIGTERM, Ctrl-C or an error in the sweep process, each running trial gets
    SIGTERM (it finishes its step, saves and exits 75; a continued sweep counts it failed) and is waited for, killed
    past its grace period; SIGTERM then ends the sweep with status 75. A SIGKILLed sweep's trials get SIGTERM from
    the kernel (`pruning_callback`: PR_SET_PDEATHSIG). Was: the trials trained on, orphaned."""
    import signal
    import threading

    def preempted(signum: int, frame: Any) -> None:
        raise _SweepPreempted

    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, preempted) if main else None
    try:
        yield
    except _SweepPreempted:
        _stop(running, sweep)
        print(
            f"preempted: the sweep stopped on SIGTERM, and its {len(running)} running trial(s) with it (their "
            f"checkpoints are kept; they count as failed); run the same command to continue the sweep",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(75) from None
    finally:
        _stop(running, sweep)
        if main:
            signal.signal(signal.SIGTERM, previous)


def _stop(running: dict[int, tuple[Any, subprocess.Popen, Path]], sweep: Sweep) -> None:
    procs = [proc for _, proc, _ in running.values() if proc.poll() is None]
    for proc in procs:
        proc.terminate()
    deadline = time.monotonic() + sweep.base.train.preempt_grace_s + 15
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _records(run_dir: Path) -> list[dict[str, Any]]:
    # import cost: the sweep's own process stays free of torch (the trials train in processes of their own)
    from graphtrain.runs.plot import read_records

    path = run_dir / "metrics.jsonl"
    return read_records(path) if path.is_file() else []


def _outcome(returncode: int, run_dir: Path) -> tuple[str, float | None]:
    recs = _records(run_dir)
    if returncode != 0:
        return "failed", None
    if any(r.get("kind") == "stopped" for r in recs):
        return "pruned", None
    val = [r["val_loss"] for r in recs if r.get("kind") == "eval" and isinstance(r.get("val_loss"), (int, float))]
    if not val or not math.isfinite(val[-1]):
        return "failed", None
    return "complete", float(val[-1])


def write_summary(sweep: Sweep, study: Any, log: Any = print) -> dict[str, Any]:
    import optuna

    rows = []
    for t in study.trials:
        run_dir = sweep.out / f"trial-{t.number:03d}"
        recs = _records(run_dir)
        evals = [r["val_loss"] for r in recs if r.get("kind") == "eval" and isinstance(r.get("val_loss"), float)]
        steps = max((r.get("step", 0) for r in recs), default=0)
        rows.append(
            {
                "trial": t.number,
                "state": {"COMPLETE": "complete", "PRUNED": "pruned"}.get(t.state.name, t.state.name.lower()),
                "params": t.params,
                "val_loss": t.value if t.value is not None else (evals[-1] if evals else None),
                "steps": steps,
                "run_dir": str(run_dir),
            }
        )
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    summary: dict[str, Any] = {
        "sweep": str(sweep.path),
        "trials": rows,
        "counts": {s: sum(r["state"] == s for r in rows) for s in ("complete", "pruned", "failed")},
    }
    if complete:
        best = min(complete, key=lambda t: t.value)
        job = sweep.base.with_overrides({**best.params, "train.out_dir": f"runs/best-of-{sweep.out.name}"})
        (sweep.out / "best.yaml").write_text(
            f"# best of {sweep.path} (trial {best.number}, val loss "
            f"{best.value:.4f}): graphtrain train {sweep.out / 'best.yaml'}\n" + job.to_yaml()
        )
        summary["best"] = {
            "trial": best.number,
            "val_loss": best.value,
            "params": best.params,
            "config": str(sweep.out / "best.yaml"),
        }
        summary["edge_warnings"] = edge_warnings(sweep.space, best.params)
        ranked = sorted(complete, key=lambda t: t.value)[:3]
        from graphtrain.runs.plot import write_report  # import cost: as in _records

        try:
            summary["report"] = str(
                write_report(
                    [sweep.out / f"trial-{t.number:03d}" for t in ranked],
                    sweep.out / "report.html",
                    title=f"best trials of {sweep.path}",
                )
            )
        except ValueError:  # a best run without metrics (deleted): the summary stands without the page
            pass
    (sweep.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    log(_table(rows))
    if "best" in summary:
        log(
            f"best: trial {summary['best']['trial']}, val loss {summary['best']['val_loss']:.4f}, "
            f"{summary['best']['params']} -> {summary['best']['config']}"
        )
        for line in summary["edge_warnings"]:
            log(f"warning: {line}")
    return summary


def edge_warnings(space: dict[str, tuple[str, list[Any]]], params: dict[str, Any]) -> list[str]:
    """One line per parameter whose best value lies at an edge of its search range (see the module docstring),
    naming the range to search next (shifted by half its width; for log_uniform by the square root of its ratio)."""
    out = []
    for key, (kind, args) in space.items():
        if key not in params:
            continue
        value = params[key]
        if kind == "choices":
            numbers = [a for a in args if isinstance(a, (int, float)) and not isinstance(a, bool)]
            if len(numbers) != len(args) or len(set(numbers)) < 3 or value not in (min(numbers), max(numbers)):
                continue
            side = "lowest" if value == min(numbers) else "highest"
            out.append(
                f"the best {key}={value:g} is the {side} of its choices {args}: the optimum may lie beyond "
                f"it; add choices {'below' if side == 'lowest' else 'above'} {value:g}"
            )
            continue
        low, high = float(args[0]), float(args[1])
        if high <= low:
            continue
        log = kind == "log_uniform"
        f = math.log if log else float
        pos = (f(float(value)) - f(low)) / (f(high) - f(low))
        at_low, at_high = pos <= EDGE_FRACTION, pos >= 1 - EDGE_FRACTION
        if not (at_low or at_high):
            continue
        if log:
            ratio = math.sqrt(high / low)
            new = (low / ratio, high / ratio) if at_low else (low * ratio, high * ratio)
        else:
            half = (high - low) / 2
            new = (low - half, high - half) if at_low else (low + half, high + half)
        if kind == "int":
            new = (math.floor(new[0]), math.ceil(new[1]))
        out.append(
            f"the best {key}={value:.3g} is at the {'low' if at_low else 'high'} edge of its range "
            f"[{low:g}, {high:g}] ({kind}): the optimum may lie outside it; search e.g. "
            f"{{{kind}: [{new[0]:.3g}, {new[1]:.3g}]}} next"
        )
    return out


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'trial':>5}  {'state':<9} {'val loss':>9} {'steps':>6}  params"]
    for r in rows:
        v = "-" if r["val_loss"] is None else f"{r['val_loss']:.4f}"
        params = ", ".join(f"{k}={x:.3g}" if isinstance(x, float) else f"{k}={x}" for k, x in r["params"].items())
        lines.append(f"{r['trial']:>5}  {r['state']:<9} {v:>9} {r['steps']:>6}  {params}")
    return "\n".join(lines)


def pruning_callback() -> Any:
    """In a trial's own process (the sweep sets the environment): report each validation loss to the study and
    return a reason to stop when the pruner says so (trainer.eval_callbacks)."""
    storage, study_name, trial_id = (os.environ.get(k) for k in (ENV_STORAGE, ENV_STUDY, ENV_TRIAL))
    if not (storage and study_name and trial_id):
        return None
    if os.environ.get(ENV_SWEEP_PID, "").isdigit():  # preempted (SIGTERM) when the sweep dies, even by SIGKILL
        die_with_parent(int(os.environ[ENV_SWEEP_PID]), signal.SIGTERM)
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    name, _, startup = os.environ.get(ENV_PRUNER, "median:2").partition(":")
    study = optuna.load_study(study_name=study_name, storage=storage, pruner=_pruner(name, int(startup or 2)))
    trial = optuna.Trial(study, int(trial_id))

    def report(step: int, val_loss: float) -> str | None:
        if not math.isfinite(val_loss):
            return "validation loss is not finite"
        trial.report(val_loss, step)
        return "pruned by the sweep's pruner" if trial.should_prune() else None

    return report
