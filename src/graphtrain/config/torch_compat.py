"""What graphtrain does differently by torch version: the supported range and one shim per difference.

Supported: torch 2.11 (the stock build on the GPU machines, 2.11.0+cu130) through 2.14 (2.14.1 checked). An older
torch fails `import graphtrain` with an ImportError naming the range. A newer one imports with a warning: a minor
release mostly keeps the private APIs used here, and where one moved, the fix is a shim in this file. The pinned CI
torch (requirements-dev.txt) lies inside the range.

Every import of a torch API that is not the same across the range goes through a function here, so a new torch
release means reading one file. Each shim names the versions on both sides of the difference.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils import _python_dispatch

# the range itself lives in config/torch_range.py, which `import graphtrain` reads without importing torch; named here too
from graphtrain.config.torch_range import MIN_TORCH, NEWEST_TESTED, SUPPORTED, check_torch_version, parse_version  # noqa: F401

check_torch_version(torch.__version__)  # a torch imported some other way than its installed distribution


# --- symbolic sizes -----------------------------------------------------------------------------------------------
# A concrete value for a possibly symbolic size, adding no guard (for a heuristic such as a GEMM layout probe).
# torch 2.14 (and 2.13): symbolic_shapes.optimization_hint; torch 2.11 has not got it: symbolic_shapes.size_hint,
# the same contract (the hint recorded with the symbol, or `fallback`).


def _optimization_hint() -> Callable[..., int]:
    from torch.fx.experimental import symbolic_shapes

    return getattr(symbolic_shapes, "optimization_hint", None) or symbolic_shapes.size_hint


optimization_hint: Callable[..., int] = _optimization_hint()


# --- Inductor's cache keys ----------------------------------------------------------------------------------------
# The hashes of torch's and Triton's sources that key Inductor's caches. torch 2.14 (and 2.13): codecache.torch_key
# and codecache.triton_key. torch 2.11: codecache.torch_key; triton_key only in torch._inductor.runtime.triton_compat
# (where Triton is installed); `codecache.triton_key` raised AttributeError there (issue #48, provider auto).


def inductor_cache_key_functions() -> list[Any]:
    """The cache-key functions this torch has (for prefetching them): torch_key, and triton_key where found."""
    import torch._inductor.codecache as codecache

    keys = [codecache.torch_key]
    triton_key = getattr(codecache, "triton_key", None)
    if triton_key is None:
        try:
            from torch._inductor.runtime.triton_compat import HAS_TRITON
            from torch._inductor.runtime.triton_compat import triton_key as compat_key

            triton_key = compat_key if HAS_TRITON else None
        except ImportError:
            triton_key = None
    return keys + ([triton_key] if triton_key is not None else [])


# --- TF32 -----------------------------------------------------------------------------------------------------------
# Whether the user allows TF32 for fp32 matmuls on CUDA. torch 2.9+ has the per-backend setting
# torch.backends.cuda.matmul.fp32_precision ("tf32" | "ieee" | "none": follow torch.backends.fp32_precision);
# the legacy torch.backends.cuda.matmul.allow_tf32 / set_float32_matmul_precision still work, but reading the
# legacy flag raises once the new API set something ("mix of the legacy and new APIs"), so the new one is read first.


def cuda_matmul_allows_tf32() -> bool:
    matmul = torch.backends.cuda.matmul
    try:
        precision = getattr(matmul, "fp32_precision", None)
        if precision == "none":
            precision = getattr(torch.backends, "fp32_precision", "none")
        if precision in ("tf32", "ieee"):
            return precision == "tf32"
    except RuntimeError:
        pass
    try:
        return bool(matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"
    except RuntimeError:  # a mix of the two APIs that torch refuses to read: fp32 stays exact
        return False


# --- is_compiling while graphtrain traces a user's code -----------------------------------------------------------
# torch.compiler.is_compiling() reads the module flag _is_compiling_flag in every torch of the range (2.11 to 2.14);
# torch.export's non-strict tracing sets it while make_fx runs the user's code (torch/_export/utils.py
# _compiling_state_context), so that library code takes its traceable branches. Without the flag (a torch that moved
# it) tracing goes on as before: the data-dependent reads it avoids fall back, named, as they did.
@contextlib.contextmanager
def compiling_flag() -> Iterator[None]:
    """torch.compiler.is_compiling() is True inside: Hugging Face's mask helpers then build the mask instead of
    reading the padding mask's values to decide whether it can be skipped (which a fake tensor cannot answer)."""
    compiler = torch.compiler
    if not isinstance(getattr(compiler, "_is_compiling_flag", None), bool):
        yield
        return
    old = compiler._is_compiling_flag
    compiler._is_compiling_flag = True
    try:
        yield
    finally:
        compiler._is_compiling_flag = old


# --- a TorchDispatchMode around a compiled call ---------------------------------------------------------------------
# Dynamo compiles nothing while a user's TorchDispatchMode is on the stack (FlopCounterMode, a logging or debug mode);
# it runs the frame eagerly. Up to torch 2.13 it also marks every code object it met then as "skip" for good, so the
# model runs eagerly from then on, outside the mode too, without a word (pytorch/pytorch#190286; 2.14 skips only the
# call under the mode). Measured on 2.13.0: one HF Llama step under a no-op mode took graphtrain's bf16 step from 230
# ms to 440 ms for every later step. The same test as Dynamo's (convert_frame, 2.13 and 2.14): a mode on the stack
# that is not one of torch's infrastructure modes and does not ask to be left out of compiled internals.


def user_dispatch_mode() -> str | None:
    """The class name of a TorchDispatchMode on the stack for which Dynamo would skip the call, None if none (every
    accelerated call asks: an empty stack is one C call)."""
    for i in range(torch._C._len_torch_dispatch_stack()):
        mode = _python_dispatch._get_dispatch_stack_at(i)
        if getattr(mode, "is_infra_mode", lambda: False)():
            continue
        if getattr(mode, "ignore_compile_internals", lambda: False)():
            continue
        return type(mode).__name__
    return None


# torch 2.11 to 2.13 mark the code "skip" for good after a call under such a mode; 2.14 returns the same skip with
# apply_to_code=False (the frame only: pytorch/pytorch#190287). The same change for frames compiled by graphtrain's
# backend, on the torches that lack it: `torch.compile(model, backend="graphtrain")` has no call wrapper of graphtrain's
# to keep such a call away from Dynamo (accelerate's does). Other backends' frames keep their torch's behaviour.
_DISPATCH_MODE_SKIP = "non-infra torch dispatch mode present"


def _compiled_by(wrapper: Any, is_ours: Callable[[Any], bool]) -> bool:
    backend = wrapper
    for _ in range(8):  # CatchErrorsWrapper -> ConvertFrame -> WrapBackendDebug -> _TorchCompileWrapper -> function
        if backend is None:
            return False
        if is_ours(backend):
            return True
        backend = getattr(backend, "_torchdynamo_orig_backend", None) or getattr(backend, "compiler_fn", None)
    return False


def skip_dispatch_mode_calls_only(is_ours: Callable[[Any], bool]) -> bool:
    """On torch 2.11 to 2.13, make Dynamo's skip of a call under a user's TorchDispatchMode apply to that call only,
    for frames whose backend `is_ours` accepts. Returns whether the change is in place (False on torch 2.14 and
    later, which need none, and on a torch whose Dynamo has not got the pieces it changes)."""
    if parse_version(torch.__version__) >= (2, 14):
        return False
    from torch._dynamo import convert_frame

    wrapper_cls = getattr(convert_frame, "CatchErrorsWrapper", None)
    handle_skip = getattr(wrapper_cls, "_handle_skip", None)
    if handle_skip is None or getattr(handle_skip, "_graphtrain_transient", False):
        return handle_skip is not None
    from torch._dynamo.types import ConvertFrameReturn

    if "apply_to_code" not in getattr(ConvertFrameReturn, "__dataclass_fields__", {}):
        return False

    def _handle_skip(self: Any, result: Any, frame: Any) -> Any:
        reason = getattr(result, "skip_reason", None)
        if reason and reason.startswith(_DISPATCH_MODE_SKIP) and _compiled_by(self, is_ours):
            result.apply_to_code = False
        return handle_skip(self, result, frame)

    _handle_skip._graphtrain_transient = True  # type: ignore[attr-defined]
    wrapper_cls._handle_skip = _handle_skip  # type: ignore[union-attr]
    return True


# --- one recompile budget per accelerated model -------------------------------------------------------------------
# Dynamo keeps compiled code on the code object, and its recompile limit (8) counts every entry of that code: each
# `graphtrain.accelerate(model)` compiles with a backend of its own, so the 9th model of one class in a process (an
# in-process sweep, a notebook cell run again) found the limit reached and ran eagerly. torch 2.13 and 2.14 have
# `torch.compile(..., isolate_recompiles=True)`: each compile call counts its own entries (still capped in all by
# torch._dynamo.config.accumulated_recompile_limit, 256). torch 2.11 and 2.12: not known to have it (not checked
# here), so nothing is passed there and the shared limit stays.


@functools.cache
def isolated_compile_options() -> dict[str, Any]:
    """torch.compile keyword arguments that give one compile call a recompile budget of its own, where supported."""
    return {"isolate_recompiles": True} if "isolate_recompiles" in inspect.signature(torch.compile).parameters else {}


def allow_retained_backward() -> None:
    """Switch off AOTAutograd's donated buffers for the process, so that a compiled graph's backward can run with
    ``retain_graph=True`` (two losses backpropagated one after the other, a gradient penalty), as in eager.

    With donation on (torch's default), a backward compiled before any retained backward lets Inductor reuse its
    saved tensors' memory, and every later ``backward(retain_graph=True)`` through it raises "compiled with
    non-empty donated buffers". Plain torch.compile compiles the backward lazily, so a model whose first backward
    retains compiles it without donation; graphtrain compiles backwards ahead (the background Inductor compile,
    the tiered switch), so such a loop raised at its second step (HF Llama, two losses). The switch has to be
    process-wide: the check reads the flag at every backward, and a graph compiled with the flag off has no
    donation record, which the check reads as a donation. Measured cost (2-core Zen 4, HF GPT-2 mini fp32 with and
    without recompute, HF Llama mini bf16, 2 runs each): step peaks 840-892 against 840-849 MiB, 884-908 against
    883-898, 837-886 against 805-854, and the same step times, i.e. within noise: graphtrain's aten graphs never
    reuse an input's memory and its Inductor graphs gained nothing measurable from it."""
    import torch._functorch.config as functorch_config

    if hasattr(functorch_config, "donated_buffer"):
        functorch_config.donated_buffer = False


def regions_take_dtensors() -> bool:
    """Whether Dynamo traces a ``nested_compile_region`` whose inputs are DTensors (tensor-parallel blocks). torch
    2.11.0 fails the capture ("Expected FakeTensor, got DTensor" while collecting the region's inputs); 2.13.0 and
    2.14.1 trace it. 2.12 was not tried, so it counts as failing: its blocks compile inside the model's graph."""
    return parse_version(torch.__version__) >= (2, 13)


@functools.cache
def torchrun_shutdown_timeout_flag() -> str | None:
    """torchrun's option for how long its agent waits for signalled workers before SIGKILL, or None where it has
    none: torch 2.11's torchrun rejects ``--shutdown-timeout`` ("unrecognized arguments") and waits its fixed 30 s."""
    from torch.distributed.run import get_args_parser

    known = get_args_parser()._option_string_actions
    return "--shutdown-timeout" if "--shutdown-timeout" in known else None


def source_names_only_when_logged() -> None:
    """Dynamo names the function of every source line it records a graph node from, for its ``trace_call`` and
    ``trace_source`` debug logs, and builds that name whether the logs are on or not: the first line it sees in a
    file has the whole file tokenized (``torch._dynamo.funcname_cache``). Measured with torch 2.13 on a warm first
    step of a 24-layer Hugging Face GPT-2 (2-core Zen 4): 0.65 s of its 2.7 s trace, 0.30 s of it for
    torch/nn/functional.py alone. The name reaches nothing but those two logs, so while both are off it is left
    out (the log line reads ``file:line in function`` without the qualified name); with either on, Dynamo's own
    lookup runs. Process-wide and idempotent, as models/hf_calls.py ``trace_through_log_once``."""
    try:
        sc = importlib.import_module("torch._dynamo.symbolic_convert")
        og = importlib.import_module("torch._dynamo.output_graph")
    except ImportError:
        return
    original = getattr(sc, "get_funcname", None)
    if original is None or getattr(original, "_graphtrain_lazy", False):
        return
    loggers = [
        lg
        for lg in (
            getattr(sc, "trace_call_log", None),
            getattr(sc, "trace_source_log", None),
            getattr(og, "trace_call_log", None),
        )
        if lg is not None
    ]

    def get_funcname(filename: str, lineno: int) -> str | None:
        if any(lg.isEnabledFor(logging.DEBUG) for lg in loggers):
            return original(filename, lineno)
        return None

    get_funcname._graphtrain_lazy = True  # type: ignore[attr-defined]
    sc.get_funcname = get_funcname
