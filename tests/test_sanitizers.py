"""The C++ kernels under AddressSanitizer and UndefinedBehaviorSanitizer (issue #49, item 4), slow suite.

GRAPHTRAIN_SANITIZE=address,undefined makes kernels/_cpu_ext.py build its extension with ``-fsanitize=address,undefined
-fno-omit-frame-pointer -g`` under a name and folder of its own (the first build takes a few minutes); Python itself
is not instrumented, so the child processes start with the ASan runtime preloaded (LD_PRELOAD of gcc's libasan.so)
and without leak checking (Python keeps its objects to the end by design). Under that, the kernel tests and the
layout fuzzing (their default budgets; the fuzzing's own child processes inherit the environment) must run clean:
no "ERROR: AddressSanitizer" (an out-of-bounds access, use after free, ... in the kernels or a bad free anywhere) and
no UBSan "runtime error:" (overflow, misaligned or null access, division by zero, ... in the kernels).

Run it: ``python -m pytest -q -m slow tests/test_sanitizers.py``; by hand, the same environment as `_sanitized_env`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNEL_TESTS = [
    "tests/test_kernels_ops.py",
    "tests/test_kernels_gemm.py",
    "tests/test_kernels_gemm_plans.py",
    "tests/test_kernels_fake_strides.py",
    "tests/test_kernel_contracts.py",
    "tests/test_fuzz_kernels.py",
    "tests/test_fuzz_attention.py",
]
REPORT = re.compile(r"ERROR: AddressSanitizer|runtime error:|ERROR: LeakSanitizer|AddressSanitizer: CHECK failed")


def _gcc_lib(name: str) -> str:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("no gcc: the sanitizer build needs gcc's sanitizer runtimes")
    path = subprocess.run([gcc, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(path) or not os.path.exists(path):
        pytest.skip(f"gcc has no {name} (it printed {path!r})")
    return os.path.realpath(path)


def _sanitized_env(logs: str) -> dict[str, str]:
    """The environment of a sanitized run. libstdc++ is preloaded after libasan: Python does not link it, so when ASan
    starts it finds no __cxa_throw to intercept, and the first C++ exception (a TORCH_CHECK) then aborts the process
    with "CHECK failed: ... real___cxa_throw". Reports also go to files under `logs` (log_path): a report that ends
    the process inside a test would otherwise die with pytest's captured output."""
    env = dict(os.environ)
    env.update(
        GRAPHTRAIN_SANITIZE="address,undefined",
        LD_PRELOAD=f"{_gcc_lib('libasan.so')} {_gcc_lib('libstdc++.so')}",
        # detect_leaks=0: CPython frees little at exit by design
        ASAN_OPTIONS=f"detect_leaks=0:halt_on_error=1:symbolize=1:log_path={logs}/asan",
        UBSAN_OPTIONS=f"print_stacktrace=1:halt_on_error=0:log_path={logs}/ubsan",
    )
    return env


def _reports(text: str, logs: str) -> list[str]:
    for name in sorted(os.listdir(logs)):
        with open(os.path.join(logs, name), errors="replace") as f:
            text += f"\n{f.read()}"
    return [ln for ln in text.splitlines() if REPORT.search(ln)]


@pytest.mark.timeout(5400)  # ASan slows the run ~2-3x; ~12 min alone on the 2-core Zen 5 EPYC
def test_kernel_tests_and_fuzzing_run_clean_under_asan_and_ubsan(tmp_path):
    logs = str(tmp_path)
    env = _sanitized_env(logs)
    # the sanitized build is the one that loads (a failed build raises under GRAPHTRAIN_SANITIZE, never falls back)
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "from graphtrain.kernels import _cpu_ext\n_cpu_ext.load()\nprint(_cpu_ext.loaded_variant())",
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert probe.returncode == 0 and "address sanitizer, undefined sanitizer" in probe.stdout, (
        f"the sanitized C++ kernels did not load (rc {probe.returncode}): {probe.stdout}{probe.stderr[-3000:]}"
    )
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", *KERNEL_TESTS],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3000,
    )
    out = run.stdout + run.stderr
    reports = _reports(out, logs)
    assert not reports, f"{len(reports)} sanitizer report(s):\n" + "\n".join(reports[:20]) + f"\n{out[-6000:]}"
    assert run.returncode == 0, f"the kernel tests failed under the sanitizers (rc {run.returncode}):\n{out[-6000:]}"
    assert re.search(r"\d+ passed", run.stdout), out[-3000:]


def test_the_sanitizers_see_an_out_of_bounds_read(tmp_path):
    """The job above can fail: the same environment reports a heap read past a tensor's end in a tiny extension
    built with the same flags."""
    env = _sanitized_env(str(tmp_path))
    code = r"""
import torch
from torch.utils.cpp_extension import load_inline
src = '''
#include <torch/extension.h>
double read_past(torch::Tensor t) {
  const float* p = t.data_ptr<float>();
  volatile float x = p[t.numel() + 3];
  return x;
}
'''
flags = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-g", "-O1"]
m = load_inline("graphtrain_asan_selfcheck", cpp_sources=[src], functions=["read_past"], extra_cflags=flags,
                extra_ldflags=flags)
print(m.read_past(torch.empty(5)))
"""
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert r.returncode != 0 and any("heap-buffer-overflow" in ln for ln in _reports(r.stderr, str(tmp_path))), (
        r.returncode,
        r.stderr[-3000:],
    )
