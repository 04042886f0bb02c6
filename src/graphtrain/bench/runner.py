"""Run a suite: one long-lived worker process per (case, variant), timed in interleaved rounds.

Why long-lived workers rather than a fresh process per measurement: a cold torch.compile costs
40-66 s per model here, so restarting per repeat would spend most of the run compiling. Instead
every variant of a case is set up once (sequentially, so each time-to-first-step is measured on an
idle machine), warmed up, and then the runner asks each worker in turn for one block of `steps`
steps: round 0 runs A B C, round 1 B C A, and so on. Noise that drifts over minutes (turbo, other
tenants) then hits every variant alike, and the per-round ratios show the spread honestly. Idle
workers only hold memory; `Suite.max_workers` bounds how many are alive at once for big models.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from graphtrain.bench.suites import Case, Suite, Variant
from graphtrain.bench.worker import FLOOR_TIMEOUT_S, SETUP_TIMEOUT_S, STEP_TIMEOUT_S, WorkerProc
from graphtrain.trainer.runinfo import cpu_name

# Imports inside functions: import cost: the suite's parent process schedules workers and writes tables; the engine
# loads in the workers, each with its own environment.


def _failed(reply: dict[str, Any]) -> dict[str, Any]:
    if "skipped" in reply:
        return {"status": "skipped", "reason": reply["skipped"]}
    return {"status": "error", "reason": reply.get("error", "unknown error")}


def pins_mmap(variants: list[Variant]) -> bool:
    """Whether this run's workers pin glibc's mmap threshold: all of them when any variant uses graphtrain's
    recompute (which pins it, runtime/backend.py), none otherwise (then they all keep freed blocks, what graphtrain
    sets without recompute), so every variant of a table runs in the same process environment."""
    return any(v.recompute != "none" for v in variants)


def skip_reason(variant: Variant, device: str, allow_slow_bf16: bool = False) -> str | None:
    """Why `variant` is not run on this machine (None: it runs)."""
    if variant.precision == "bf16" and not allow_slow_bf16:
        from graphtrain.kernels import capability

        fast, why = capability.bf16_is_fast(device)
        if not fast:
            return f"bf16 not measured here: {why} (--allow-slow-bf16 runs it anyway)"
    return None


def run_case(
    case: Case,
    variants: list[Variant],
    suite: Suite,
    device: str,
    log_dir: Path,
    tick: Callable[[str], None],
    pin_mmap: bool = False,
    allow_slow_bf16: bool = False,
    floor_peak: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Set up, warm up and time every variant of one case, interleaved; returns per-variant records. With
    `floor_peak` (the run's measured peak) eager-fp32 and eager-bf16 also measure their step's GEMM floor
    (gemm_floor.py) after the timed rounds."""
    records: dict[str, dict[str, Any]] = {v.name: {"variant": v.name} for v in variants}
    for v in variants:
        why = skip_reason(v, device, allow_slow_bf16)
        if why:
            records[v.name].update(status="skipped", reason=why)
    variants = [v for v in variants if "status" not in records[v.name]]
    for start in range(0, len(variants), suite.max_workers):
        group = variants[start : start + suite.max_workers]
        live: list[tuple[Variant, WorkerProc]] = []
        for v in group:
            tick(f"{case.name} | {v.name} | setup (first step, compiles)")
            w = WorkerProc(case, v, device, log_dir / f"{_slug(case.name)}.{v.name}.log", pin_mmap=pin_mmap)
            reply = w.call("setup", SETUP_TIMEOUT_S)
            if reply.get("ok"):
                records[v.name].update(
                    status="ok", setup={k: x for k, x in reply.items() if k != "ok"}, step_s=[], round_losses=[]
                )
                live.append((v, w))
            else:
                records[v.name].update(_failed(reply))
                w.close(kill=True)
        _interleave(case, live, records, suite, tick)
        for v, w in live:
            if records[v.name]["status"] == "ok":
                floor = floor_peak is not None and v.name == f"eager-{v.precision}"  # what the roofline reads
                args = {"gemm_floor": True, "peak_flops": floor_peak.get(v.precision)} if floor else {}
                reply = w.call("finish", FLOOR_TIMEOUT_S if floor else 120.0, **args)
                if reply.get("ok"):
                    records[v.name].update({k: x for k, x in reply.items() if k != "ok"})
            w.close()
    return records


def _interleave(
    case: Case,
    live: list[tuple[Variant, WorkerProc]],
    records: dict[str, dict[str, Any]],
    suite: Suite,
    tick: Callable[[str], None],
) -> None:
    timeout = 60.0 + STEP_TIMEOUT_S * max(suite.steps, suite.warmup)
    for v, w in live:
        tick(f"{case.name} | {v.name} | warmup")
        if suite.warmup:
            reply = w.call("steps", timeout, n=suite.warmup)
            if not reply.get("ok"):
                records[v.name].update(_failed(reply))
    for r in range(suite.repeats):
        k = r % max(len(live), 1)
        for v, w in live[k:] + live[:k]:  # rotate the order each round: A B C, B C A, C A B
            tick(f"{case.name} | {v.name} | round {r + 1}/{suite.repeats}")
            rec = records[v.name]
            if rec["status"] != "ok":
                continue
            reply = w.call("steps", timeout, n=suite.steps, reset_peak=(r == 0))
            if not reply.get("ok"):
                rec.update(_failed(reply))
                continue
            rec["step_s"].append(reply["seconds"] / reply["steps"])
            if reply.get("opt_seconds") is not None:
                rec.setdefault("opt_s", []).append(reply["opt_seconds"] / reply["steps"])
            rec["round_losses"].append(reply["loss"])


def _slug(s: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in s)


# ------------------------------------------------------------------------------ environment ----

ISA_ENV = (
    "GRAPHTRAIN_SIMULATE_CPU",
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "MKL_ENABLE_INSTRUCTIONS",
    "MKL_DEBUG_CPU_TYPE",
)
"""Environment variables that limit the instruction set torch, oneDNN, MKL or graphtrain use: recorded with each run
and named in its machine line."""


def environment(device: str) -> dict[str, Any]:
    """Versions and machine facts recorded with every run."""
    import torch

    import graphtrain
    from graphtrain.kernels import capability

    c = capability.cpu()
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "graphtrain": graphtrain.__version__,
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "device": device,
        "cpu_flags": _cpu_flags(),
        "cpu_family_model": _cpu_family_model(),
        "isa": c.isa,
        "torch_isa": c.torch_isa,
        "git_sha": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "loadavg_start": _loadavg(),
        "simulated": c.simulated or None,
        # what changes the code a run executes without changing the machine: a simulated CPU
        "isa_env": {k: os.environ[k] for k in ISA_ENV if os.environ.get(k)},
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    if device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
    return env


IDLE_READ_MIB = 64
"""The block the idle-read probe copies: larger than the caches of the CPUs seen so far, so it reads memory."""


def idle_read_penalty(idle_s: float = 0.5, rounds: int = 3) -> dict[str, float]:
    """How much slower this machine reads memory left alone for `idle_s` seconds than memory it just read: a 64 MiB
    fp32 block copied to bf16 on torch's threads, the fastest of 3 copies back to back against the median of `rounds`
    copies each after `idle_s` asleep. On the 2-core AMX Xeon VM (2026-11-30) a 128 MiB copy after 0.5 s asleep took
    3-4x the copy back to back at 21:30 UTC, and this probe read 1.3x at 22:00; a training step's large blocks
    (gradients, optimizer state) cost what that state makes them cost: docs/design/benchmarks.md, "Why this machine
    has slow periods". Recorded at a run's start and end, so that two runs' figures can be read against the
    machine's state. About 2 s."""
    import torch

    src = torch.ones(IDLE_READ_MIB << 18)
    dst = torch.empty(src.shape, dtype=torch.bfloat16)

    def copy_ms() -> float:
        t = time.perf_counter()
        dst.copy_(src)
        return (time.perf_counter() - t) * 1e3

    copy_ms()  # faults the destination in
    hot = min(copy_ms() for _ in range(3))
    idle = []
    for _ in range(rounds):
        time.sleep(idle_s)
        idle.append(copy_ms())
    after = statistics.median(idle)
    return {"idle_s": idle_s, "hot_ms": round(hot, 2), "idle_ms": round(after, 2), "ratio": round(after / hot, 2)}


def _loadavg() -> list[float] | None:
    """1/5/15-minute load averages: other work on the machine is the first suspect for noise."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _cpu_family_model() -> str | None:
    """ "family F model M" from /proc/cpuinfo (which EPYC generation, e.g. family 23 = Zen 1, 25 = Zen 3/4)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key = line.split(":", 1)[0].strip()
            if key in ("cpu family", "model") and key not in fields:
                fields[key] = line.split(":", 1)[1].strip()
            if len(fields) == 2:
                break
    except OSError:
        return None
    return f"family {fields.get('cpu family', '?')} model {fields.get('model', '?')}" if fields else None


def _cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return sorted(
                    f
                    for f in line.split(":", 1)[1].split()
                    if f.startswith(("avx512_bf16", "amx", "avx2")) or f == "avx512f"
                )
    except OSError:
        pass
    return []


def _git(*args: str) -> str | None:
    """Read-only git queries about the checkout graphtrain was imported from."""
    import graphtrain

    root = Path(graphtrain.__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def measure_peak_subprocess(device: str) -> dict[str, Any]:
    """The fp32/bf16 matmul peak, measured in a fresh process (see graphtrain.kernels.flops)."""
    cmd = [sys.executable, "-m", "graphtrain.kernels.flops", "--device", device]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        return {"error": out.stderr.strip()[-400:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).astimezone().isoformat(timespec="seconds")


# ------------------------------------------------------------------------------------ suite ----


def run_suite(
    suite: Suite,
    variants: list[Variant],
    cases: tuple[Case, ...],
    device: str = "cpu",
    out_dir: Path = Path("bench_results"),
    maxbatch: bool | None = None,
    progress: bool = True,
    command: str = "",
    measure_peak: bool = True,
    gemm_floor: bool = False,
    on_case: Callable[[dict[str, Any]], None] | None = None,
    allow_slow_bf16: bool = False,
) -> dict[str, Any]:
    """Run `cases` x `variants` of `suite`; returns the run record (see report.summarize).

    `on_case(run)` is called after every case with the partial record, so a long run that is
    interrupted keeps what it measured (the CLI writes <suite>-<time>.partial.json)."""
    from tqdm.auto import tqdm

    from graphtrain.bench import maxbatch as mb
    from graphtrain.memory.allocator import huge_pages_available

    started = now_iso()
    log_dir = out_dir / "logs" / f"{suite.name}-{started.replace(':', '')[:17]}"
    pinned = pins_mmap(variants)
    run: dict[str, Any] = {
        "suite": suite.name,
        "started": started,
        "command": command,
        "env": {**environment(device), "idle_read_start": idle_read_penalty()},
        "settings": {
            "steps": suite.steps,
            "repeats": suite.repeats,
            "warmup": suite.warmup,
            "cap_gib": suite.cap_gib,
            "device": device,
            "max_workers": suite.max_workers,
            "threads": os.cpu_count(),
            "variants": [v.name for v in variants],
            "pin_mmap": pinned,
            "allocator": "release" if pinned else "keep",
            "huge_pages": huge_pages_available()[0],
        },
        "log_dir": str(log_dir),
        "cases": [],
    }
    total = sum(len(variants) * (suite.repeats + 2) for _ in cases)
    bar = tqdm(total=total, desc=f"bench {suite.name}", unit="op", disable=not progress, dynamic_ncols=True)

    def tick(what: str) -> None:
        bar.set_postfix_str(what, refresh=True)

    try:
        if measure_peak:
            tick("measuring the matmul peak")
            run["peak"] = measure_peak_subprocess(device)
        for case in cases:
            done_before = bar.n

            def step_tick(what: str) -> None:
                bar.update(1)
                tick(what)

            records = run_case(
                case,
                variants,
                suite,
                device,
                log_dir,
                step_tick,
                pin_mmap=pins_mmap(variants),
                allow_slow_bf16=allow_slow_bf16,
                floor_peak=run.get("peak", {}) if gemm_floor else None,
            )
            bar.n = done_before + len(variants) * (suite.repeats + 2)  # skipped variants tick less
            bar.refresh()
            if maxbatch if maxbatch is not None else case.maxbatch:
                for v in variants:
                    rec = records[v.name]
                    if rec.get("status") != "ok":
                        continue
                    known = {case.batch: rec["peak_mem_mib"]} if rec.get("peak_mem_mib") else None
                    rec["maxbatch"] = mb.search(
                        case, v, suite.cap_gib, device, log_dir, known, tick, pin_mmap=pins_mmap(variants)
                    )
            run["cases"].append({"name": case.name, "case": dict(case.__dict__), "variants": records})
            if on_case is not None:
                on_case(run)
    finally:
        bar.close()
    run["finished"] = now_iso()
    run["env"]["loadavg_end"] = _loadavg()
    run["env"]["idle_read_end"] = idle_read_penalty()
    return run
