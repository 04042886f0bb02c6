"""A benchmark worker: a long-lived `python -m graphtrain.bench.case` process and its JSON-lines channel, shared
by the suite runner (runner.py) and the largest-batch search (maxbatch.py)."""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from graphtrain.bench.case import REPLY
from graphtrain.bench.suites import Case, Variant

# Imports inside functions: import cost: the parent process only starts workers and reads their JSON lines.

SETUP_TIMEOUT_S = 3600.0  # a cold compile of a large model on 2 cores is slow; a hung worker is not
STEP_TIMEOUT_S = 600.0  # per step, on top of a fixed minute
FLOOR_TIMEOUT_S = 1800.0  # the GEMM floor: one step, then each distinct matmul timed alone (~0.2 s each)


def worker_env() -> dict[str, str]:
    """The workers' environment: this process's, with torch's own Inductor cache (what the torch.compile baselines
    use; graphtrain's variants point Inductor at graphtrain's cache) in a folder of its own when Inductor is told to
    generate C++ for another vector ISA than the machine's (ATEN_CPU_CAPABILITY, as the AVX2 simulation sets it).
    torch 2.13 leaves the ISA out of its cache keys, and its C++ is compiled again at load time for the loading
    process's ISA: a native run that loaded the AVX2 code a simulated run had cached wrote past its buffers (the
    torch.compile workers died with "malloc(): unaligned tcache chunk detected"). graphtrain's own Inductor keys
    carry the ISA (runtime/providers.py). A TORCHINDUCTOR_CACHE_DIR naming torch's default counts as unset: torch's
    `cache_dir()` writes the default into the environment the first time this process asks for it, and the workers
    started after that (a run's second variant on) had loaded AVX-512 code under AVX2 and died."""
    import os

    env = dict(os.environ)
    isa = env.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if isa:
        from graphtrain.pipeline.cache import user_set_inductor_cache

        if not user_set_inductor_cache(env):
            from torch._inductor.runtime.cache_dir_utils import default_cache_dir

            env["TORCHINDUCTOR_CACHE_DIR"] = f"{default_cache_dir()}-isa-{isa}"
    return env


class WorkerProc:
    """A `python -m graphtrain.bench.case` process and its JSON-lines channel."""

    def __init__(self, case: Case, variant: Variant, device: str, log_path: Path, pin_mmap: bool = False) -> None:
        spec = json.dumps({"case": case.__dict__, "variant": variant.name, "device": device, "pin_mmap": pin_mmap})
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "graphtrain.bench.case", spec],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            bufsize=1,
            env=worker_env(),
        )

    def call(self, op: str, timeout: float, **args: Any) -> dict[str, Any]:
        try:
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return self._died()
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close(kill=True)
                return {"ok": False, "error": f"{op} timed out after {timeout:.0f} s (log: {self.log_path})"}
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 5.0))
            if not ready:
                continue
            line = self.proc.stdout.readline()
            if not line:
                return self._died()
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY) :])

    def _died(self) -> dict[str, Any]:
        rc = self.proc.wait(timeout=30)
        tail = log_tail(self.log_path)
        why = "killed by the OOM killer?" if rc in (-9, 137) else f"exit code {rc}"
        return {"ok": False, "error": f"worker died ({why}): {tail}"}

    def close(self, kill: bool = False) -> None:
        if self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                try:
                    self.proc.stdin.close()  # type: ignore[union-attr]
                except OSError:
                    pass
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def log_tail(path: Path, lines: int = 3) -> str:
    try:
        text = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    return " | ".join(text[-lines:])[-600:]
