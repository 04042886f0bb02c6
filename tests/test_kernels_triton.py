"""Triton kernels vs references under TRITON_INTERPRET=1, in a subprocess (the flag must precede triton's import)."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "bias_gelu", "bias_dropout_add", "cross_entropy", "attention"])
def test_triton_kernel_matches_reference(op):
    script = os.path.join(os.path.dirname(__file__), "kernel_triton_checks.py")
    r = subprocess.run([sys.executable, script, op], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0 and f"ok {op}" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
