"""Hand-written CPU kernels (C++ in kernels/csrc/, built with torch.utils.cpp_extension.load_inline), built once and
cached. The C++ lives in files, one per kernel family (`_UNITS`; `common.h` holds what they share); their contracts
live here and in _cpu_attention.py, and each contract's C++ check is generated from it (contract.py) and put where a
file includes ``gt_contracts.h``: the loader joins the files and that generated header into one source (`source()`).

Why C++ here: on the 2-core EPYC aten's Bernoulli sampler costs ~5 ns/element (2.6 ms for
a [1024, 512] fp32 mask, 50x an elementwise add), so dropout dominates every fused op that contains
it. These kernels draw the keep-mask from a counter-based hash of (seed, element index): it is
reproducible, so backward regenerates the mask instead of saving it (0 bytes of saved mask), and
it vectorizes (on AVX-512 with native 64-bit multiplies). Keep decision: hash32(seed, i) >= p * 2^32, i.e.
P(keep) = 1 - p up to 2^-32; kept values are scaled by 1/(1-p).

Portability: the sources are plain C++ (no intrinsics); gcc vectorizes them for the ISA level they are
built for. One build per level, named after it (`_ISA_FLAGS`): AVX-512 (F/BW/VL/DQ), AVX2 + FMA, or
the compiler's baseline. Never ``-march=native``: torch's extension cache keys builds by source and
flags, not by CPU, so a native build cached on an AVX-512 machine would die of SIGILL on an AVX2 one
that shares the cache. On AVX2 the hash's 64-bit multiplies are emulated from 32-bit ones (there is
no vpmullq), which changes speed, never bits: tests compare every build with the reference bit for bit.

`load()` returns the module or None (no compiler, build failure): callers then run the reference.
The extension's name is `module_name()`: a digest of the joined source, so editing any file under csrc/ (or a
contract) builds a new extension, never a stale one; there is no version number to bump. The build takes ~40 s
the first time and is cached under TORCH_EXTENSIONS_DIR afterwards, in a folder per torch install
(`build_directory`): torch keys its folder by the extension's name only, so two virtual environments sharing
~/.cache rebuilt it in turn, each first step paying ~30 s (seen between a checkout and CI's fresh clone). torch's
build lock is a plain file that a killed build leaves behind, and every later process then waits on it forever
without a word; builds here hold a kernel lock (`flock`, released when its holder dies) and clear a lock file no
live builder can own (`_stale_lock_cleared`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

from graphtrain.kernels import (
    _cpu_attention,  # noqa: F401 - registers attention's contracts, checked in the source
    capability,
)
from graphtrain.kernels.contract import Contract, Rule, cpp_checks, register_contract

# The contracts of the entry points below (contract.py): each entry point's first statement is its check, and the
# kernel files' gates evaluate the same rules before choosing it. An absent optional tensor is an empty one.
_ROWS = Rule(
    "x.dim() > 0 && x.size(-1) > 0 && cpu(x) && floating(x)",
    "x must be a floating-point CPU tensor with a non-empty last dim (the rows the kernel walks)",
)
_BIAS = Rule(
    "bias.numel() == 0 || (bias.numel() == x.size(-1) && same_dtype(bias, x) && cpu(bias))",
    "bias must be empty or hold the last dim's size, in x's dtype",
)
BIAS_DROPOUT_ADD_FWD = register_contract(
    Contract(
        "bias_dropout_add_fwd",
        ("x", "bias", "residual"),
        rules=(
            _ROWS,
            _BIAS,
            Rule(
                "residual.numel() == 0 || (same_shape(residual, x) && same_dtype(residual, x) && cpu(residual))",
                "residual must be empty or shaped and typed as x",
            ),
        ),
    )
)
DROPOUT_BWD = register_contract(
    Contract("dropout_bwd", ("g",), rules=(Rule("cpu(g) && floating(g)", "g must be a floating-point CPU tensor"),))
)
GELU_TANH_FWD = register_contract(Contract("gelu_tanh_fwd", ("x", "bias"), rules=(_ROWS, _BIAS)))
GELU_TANH_BWD = register_contract(
    Contract(
        "gelu_tanh_bwd",
        ("dy", "x", "bias"),
        rules=(
            _ROWS,
            _BIAS,
            Rule("same_shape(dy, x) && same_dtype(dy, x) && cpu(dy)", "dy must be shaped and typed as x"),
        ),
    )
)
_CE = (
    Rule(
        "x.dim() == 2 && (x.size(1) <= 1 || x.stride(1) == 1) && (x.size(0) <= 1 || x.stride(0) >= x.size(1)) && "
        "cpu(x) && floating(x)",
        "x must be a floating-point CPU [n, v] tensor of dense rows (row stride >= v)",
    ),
    Rule("int64(target) && target.is_contiguous() && target.numel() == x.size(0)", "target must be int64 [n]"),
    Rule("f32(losses) && losses.is_contiguous() && losses.numel() == x.size(0)", "losses must be fp32 [n]"),
)
CE_INPLACE = register_contract(Contract("ce_fwd_bwd_inplace", ("x", "target", "losses"), rules=_CE))
CE_ROWS = register_contract(
    Contract(
        "ce_fwd_bwd_rows",
        ("x", "src", "rows", "target", "losses"),
        rules=(
            *_CE,
            Rule(
                "src.dim() == 2 && src.is_contiguous() && src.size(1) == x.size(1) && same_dtype(src, x) && cpu(src)",
                "src must be a contiguous [m, v] tensor of x's dtype",
            ),
            Rule("int64(rows) && rows.is_contiguous() && rows.numel() == x.size(0)", "rows must be int64 [n]"),
        ),
    )
)
ONEDNN_MATMUL = register_contract(
    Contract(
        "onednn_matmul",
        ("a", "b", "out"),
        rules=(
            Rule(
                "(a.dim() == 2 || a.dim() == 3) && b.dim() == a.dim() && out.dim() == a.dim()",
                "a, b and out must all be 2-D or all 3-D",
            ),
            Rule(
                "a.size(-1) == b.size(-2) && out.size(-2) == a.size(-2) && out.size(-1) == b.size(-1) && "
                "(a.dim() == 2 || (b.size(0) == a.size(0) && out.size(0) == a.size(0)))",
                "shapes must be a [.., M, K] @ b [.., K, N] -> out [.., M, N]",
            ),
            Rule(
                "out.is_contiguous() && same_dtype(a, b) && same_dtype(a, out) && floating(a) && cpu(a) && cpu(b) && "
                "cpu(out)",
                "a, b and a contiguous out must be CPU tensors of one floating dtype",
            ),
        ),
    )
)

ONEDNN_MATMUL_ROWS = register_contract(
    Contract(
        "onednn_matmul_rows",
        ("a", "b", "out"),
        rules=(
            Rule("a.dim() == 2 && b.dim() == 2 && out.dim() == 2", "a, b and out must be 2-D"),
            *ONEDNN_MATMUL.rules[1:],
        ),
    )
)

TRANSPOSE_BF16 = register_contract(
    Contract(
        "transpose_bf16",
        ("src", "dst"),
        rules=(
            Rule(
                "src.dim() == 2 && same_shape(src, dst) && dst.is_contiguous()", "dst must be contiguous, shaped as src"
            ),
            Rule("bf16(src) && bf16(dst) && cpu(src) && cpu(dst)", "src and dst must be bf16 CPU tensors"),
            Rule(
                "(src.size(0) < 2 || src.stride(0) == 1) && (src.size(1) < 2 || src.stride(1) >= src.size(0))",
                "src must be a transposed view (stride(0) 1, stride(1) at least size(0))",
            ),
        ),
    )
)

CSRC = Path(__file__).with_name("csrc")
"""The hand-written C++ (shipped with the package): one .cpp per kernel family, headers they share."""

_UNITS = ("elementwise.cpp", "attention.cpp", "cross_entropy.cpp", "matmul.cpp", "allocator.cpp")
"""The extension's sources, in the order they are joined into its one translation unit."""

_GENERATED = "gt_contracts.h"
"""The header no file holds: every contract's C++ check (contract.py cpp_checks), generated from the Contracts above."""

_INCLUDE = re.compile(r'^#include "([^"]+)"[^\n]*\n', re.M)


def _assemble(units: tuple[str, ...], read: Callable[[str], str], generated: dict[str, str]) -> str:
    """One source from `units`: each quoted #include replaced by that header's text (`generated`'s, else `read`'s)
    the first time it is met and dropped after, as #pragma once would. One translation unit, as load_inline builds
    it, so torch's own rebuild check sees every line."""
    seen: set[str] = set()

    def expand(text: str) -> str:
        def header(m: re.Match[str]) -> str:
            name = m.group(1)
            if name in seen:
                return ""
            seen.add(name)
            return expand(generated[name] if name in generated else read(name))

        return _INCLUDE.sub(header, text)

    return "".join(expand(read(u)) for u in units)


def _read(name: str) -> str:
    return re.sub(r"^#pragma once\n", "", (CSRC / name).read_text(), flags=re.M)  # one file: no header is reread


@functools.lru_cache(maxsize=1)
def source() -> str:
    """The extension's C++: the files under csrc/ with the contracts' generated checks, read at the first call."""
    return _assemble(_UNITS, _read, {_GENERATED: cpp_checks()})


def module_name() -> str:
    """The extension's name (and build folder's) before its ISA level: `MODULE_PREFIX` and a digest of `source()`,
    so any change to a .cpp/.h file or a contract builds anew under a new name (and an older checkout's build, in a
    folder of its own, stays valid for it)."""
    return f"{MODULE_PREFIX}_{hashlib.sha256(source().encode()).hexdigest()[:12]}"


_DECLS = [
    "bias_dropout_add_fwd",
    "dropout_bwd",
    "dropout_mask",
    "gelu_tanh_fwd",
    "gelu_tanh_bwd",
    "attn_probs_fwd",
    "attn_probs_bwd",
    "attn_heads_available",
    "attn_heads_fwd",
    "attn_heads_bwd",
    "onednn_matmul",
    "onednn_matmul_rows",
    "transpose_bf16",
    "ce_fwd_bwd_inplace",
    "ce_fwd_bwd_rows",
    "block_allocator",
    "block_cache_drain",
    "block_cache_stats",
    "block_cache_prime",
    "block_cache_prime_stop",
    "block_cache_settle",
    "block_cache_record",
]

# Compiler flags per ISA level (explicit -m flags rather than -march=x86-64-v3/v4 so older compilers work).
_ISA_FLAGS: dict[str, list[str]] = {
    "avx512": [
        "-mavx2",
        "-mfma",
        "-mf16c",
        "-mbmi",
        "-mbmi2",
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mavx512cd",
        "-mprefer-vector-width=512",
        "-DCPU_CAPABILITY_AVX512",
        "-DCPU_CAPABILITY=AVX512",
    ],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-mbmi", "-mbmi2", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"],
    "baseline": ["-DCPU_CAPABILITY=DEFAULT"],
}

# No floating-point traps: we never read FP exception flags, and with -ftrapping-math (gcc's default) gcc keeps a
# loop with a float compare-and-select (the exp's range clamp, tanh's small-argument branch) scalar on AVX2 ("control
# flow in loop"; AVX-512 masks it). Bits are unchanged: nothing is reassociated or contracted differently. Measured
# on GELU's tanh, one thread: 11.1 ms scalar, 1.8 ms vectorized (AVX2 build, 2M elements).
_FP_FLAGS = ["-fno-trapping-math"]

MODULE_PREFIX = "graphtrain_cpu_kernels"
"""The start of the extension's name; `module_name()` adds the digest of its source."""

_lock = threading.Lock()
_modules: dict[str, object] = {}
_failed: dict[str, str] = {}


def isa_level() -> str:
    """The build level for this CPU (after any capability.simulate): avx512, avx2 or baseline."""
    c = capability.cpu()
    if c.arch not in ("x86_64", "AMD64"):
        return "baseline"
    return "avx512" if c.avx512 else ("avx2" if c.avx2 else "baseline")


def load(level: str | None = None):
    """The compiled module for `level` (default: this CPU's), or None if it cannot be built here (then the
    reference runs)."""
    if os.environ.get("GRAPHTRAIN_NO_CPP") == "1":
        return None
    level = level or isa_level()
    if level in _modules or level in _failed:
        return _modules.get(level)
    if level not in _ISA_FLAGS:
        raise ValueError(f"unknown ISA level {level!r}; known: {', '.join(_ISA_FLAGS)}")
    checks = sanitizers()  # a misspelt GRAPHTRAIN_SANITIZE raises here, not as a failed build
    with _lock:
        if level not in _modules and level not in _failed:
            try:
                from torch.utils.cpp_extension import load_inline

                name = f"{module_name()}_{level}" + "".join(f"_{c}" for c in checks)
                build_dir = build_directory(name)
                san = [f"-fsanitize={','.join(checks)}", "-fno-omit-frame-pointer", "-g"] if checks else []
                with _build_lock(build_dir):
                    _modules[level] = load_inline(
                        name=name,
                        cpp_sources=[source()],
                        functions=_DECLS,
                        extra_cflags=["-O3", *_ISA_FLAGS[level], "-fopenmp", *_FP_FLAGS, *san],
                        extra_ldflags=["-fopenmp", *san],
                        build_directory=build_dir,
                        verbose=False,
                    )
            except Exception as e:  # no compiler / headers: correctness first, reference path
                if checks:  # a sanitizer run on the references would check nothing: say why it cannot run
                    raise RuntimeError(
                        f"graphtrain: the {'+'.join(checks)}-sanitized CPU kernels ({level}) could not "
                        f"be built or loaded (GRAPHTRAIN_SANITIZE): {type(e).__name__}: {e}"
                    ) from e
                _failed[level] = f"{type(e).__name__}: {e}"
                warnings.warn(
                    f"graphtrain: CPU kernels ({level}) could not be built, using reference ops: "
                    f"{_failed[level][:300]}",
                    stacklevel=2,
                )
    return _modules.get(level)


SANITIZERS = ("address", "undefined")
"""What GRAPHTRAIN_SANITIZE may name (comma-separated): gcc's AddressSanitizer and UndefinedBehaviorSanitizer."""


def sanitizers() -> tuple[str, ...]:
    """The sanitizers GRAPHTRAIN_SANITIZE asks the C++ kernels to be built with (debugging and the slow suite's
    sanitizer job, tests/test_sanitizers.py): each such build has a name and folder of its own, so it never replaces
    the normal build. An ASan build loads only into a process that starts with libasan first
    (LD_PRELOAD=$(gcc -print-file-name=libasan.so), ASAN_OPTIONS=detect_leaks=0: Python frees little at exit)."""
    raw = os.environ.get("GRAPHTRAIN_SANITIZE", "")
    names = tuple(sorted({s.strip() for s in raw.split(",") if s.strip()}))
    unknown = [s for s in names if s not in SANITIZERS]
    if unknown:
        raise ValueError(
            f"GRAPHTRAIN_SANITIZE={raw!r}: unknown sanitizer {', '.join(unknown)}; use a comma-separated "
            f"list of {', '.join(SANITIZERS)} (or leave it unset)"
        )
    return names


def build_directory(name: str) -> str:
    """<TORCH_EXTENSIONS_DIR or torch's default root>/<name>-<torch version and install path digest>."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    tag = hashlib.sha256(f"{torch.__version__}|{os.path.dirname(os.path.abspath(torch.__file__))}".encode()).hexdigest()
    path = os.path.join(root, f"{name}-{tag[:12]}")
    os.makedirs(path, exist_ok=True)
    return path


@contextlib.contextmanager
def _build_lock(build_dir: str) -> Iterator[None]:
    """Serialises graphtrain's builds of one folder with flock (the kernel drops it if the holder dies), then
    removes torch's `lock` file if one is left: every builder of this folder holds the flock first, so while we
    hold it no live process can own that file."""
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's own lock alone
        yield
        return
    fd = os.open(os.path.join(build_dir, "graphtrain.flock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        _stale_lock_cleared(build_dir)
        yield
    finally:
        os.close(fd)  # closing the descriptor drops the flock


def _stale_lock_cleared(build_dir: str) -> None:
    stale = os.path.join(build_dir, "lock")
    try:
        os.remove(stale)
    except FileNotFoundError:
        return
    warnings.warn(
        f"graphtrain: removed a build lock left by a killed build of its CPU kernels ({stale}); rebuilding",
        stacklevel=2,
    )


def build_error(level: str | None = None) -> str | None:
    """Why `load(level)` returned None (None if it did not fail, or was not tried)."""
    if os.environ.get("GRAPHTRAIN_NO_CPP") == "1":
        return "GRAPHTRAIN_NO_CPP=1"
    return _failed.get(level or isa_level())


def loaded_variant() -> str | None:
    """A label of the build the current CPU uses, if it is loaded (for the report)."""
    level = isa_level()
    san = "".join(f", {c} sanitizer" for c in sanitizers())
    return f"c++ ({level} build{san})" if level in _modules else None
