"""The supported torch range and the version shims (graphtrain/config/torch_compat.py)."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from graphtrain.config import torch_compat as compat

SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.mark.parametrize("version", ["2.11.0", "2.11.0+cu130", "2.13.0+cpu", "2.14.1", "2.14.0a0+git1234"])
def test_supported_versions_import_quietly(version):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.check_torch_version(version)


@pytest.mark.parametrize("version", ["2.10.0", "2.6.0+cu124", "1.13.1"])
def test_older_torch_is_refused_naming_the_range(version):
    with pytest.raises(
        ImportError, match=r"graphtrain supports torch 2\.11 to 2\.14, found torch " + re.escape(version)
    ):
        compat.check_torch_version(version)


@pytest.mark.parametrize("version", ["2.15.0", "3.0.0"])
def test_newer_torch_imports_with_a_warning(version):
    with pytest.warns(UserWarning, match=f"tested with torch 2.11 to 2.14; torch {version} is newer"):
        compat.check_torch_version(version)


def test_import_graphtrain_runs_the_check():
    """`import graphtrain` itself refuses a torch below the range (the version string as an older torch reports
    it; nothing else of graphtrain runs before the check)."""
    code = "import torch; torch.__version__ = '2.10.0'; import graphtrain"
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == (
        "ImportError: graphtrain supports torch 2.11 to 2.14, found torch 2.10.0: install a supported one "
        "(pip install 'torch>=2.11')"
    ), r.stderr[-2000:]


def test_optimization_hint_reads_a_symbols_hint_without_a_guard():
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env, src = ShapeEnv(), ConstantSource("s")
    s = env.create_symintnode(env.create_symbol(7, src), hint=7, source=src)
    assert compat.optimization_hint(s) == 7 and compat.optimization_hint(5) == 5
    assert not env.guards


def test_inductor_cache_key_functions_are_this_torchs():
    """torch_key always; triton_key where Triton is installed, wherever this torch keeps it (2.11: not in
    codecache, the AttributeError of issue #48)."""
    import torch._inductor.codecache as codecache

    keys = compat.inductor_cache_key_functions()
    assert keys[0] is codecache.torch_key
    try:
        import triton  # noqa: F401

        has_triton = True
    except ImportError:
        has_triton = False
    assert len(keys) == 1 + has_triton and all(callable(k) for k in keys)


TF32_STATES = """
import torch
from graphtrain.config.torch_compat import cuda_matmul_allows_tf32 as tf32
m = torch.backends.cuda.matmul
seen = [tf32()]                                   # default: exact
m.allow_tf32 = True; seen.append(tf32())          # the legacy flag
m.allow_tf32 = False; seen.append(tf32())
torch.set_float32_matmul_precision("high"); seen.append(tf32())
torch.set_float32_matmul_precision("highest"); seen.append(tf32())
if hasattr(m, "fp32_precision"):                  # torch's per-backend API, which makes the legacy read raise
    m.fp32_precision = "tf32"; seen.append(tf32())
    m.fp32_precision = "ieee"; seen.append(tf32())
print(seen)
"""


def test_tf32_setting_is_read_from_either_api():
    """Both ways a user allows TF32 count, including the new API after which torch refuses legacy reads (a fresh
    process: these settings are process-wide)."""
    r = subprocess.run(
        [sys.executable, "-c", TF32_STATES],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    seen = eval(r.stdout.strip().splitlines()[-1])
    expected = [False, True, False, True, False] + (
        [True, False] if hasattr(torch.backends.cuda.matmul, "fp32_precision") else []
    )
    assert seen == expected


def test_compiling_flag_is_seen_inside_and_restored_after_an_error():
    """The shim flips the flag torch.compiler.is_compiling() reads in this torch (what torch.export sets while it
    traces), and puts the old value back however the block ends."""
    assert not torch.compiler.is_compiling()
    with pytest.raises(RuntimeError, match="inside"):
        with compat.compiling_flag():
            assert torch.compiler.is_compiling()
            raise RuntimeError("inside")
    assert not torch.compiler.is_compiling()
