"""Model FLOPs per training step, the machine's measured matmul peak, and MFU.

The FLOP formula (the nanoGPT / PaLM-appendix-B estimate) for one training step::

    flops_per_step = (6 * N + 12 * n_layer * seq * d_model) * tokens

* ``N`` is the number of matmul parameters: every distinct trainable parameter except position and
  token-type (segment) embeddings, which are looked up, never multiplied. A token embedding tied to
  the output projection counts once (it is the LM head's matmul).
* ``6 * N`` per token: 2 FLOPs per multiply-add in the forward pass, twice that in the backward pass
  (gradients for the inputs and for the weights).
* ``12 * n_layer * seq * d_model`` per token: attention scores (Q K^T) and the weighted sum (A V),
  2 * seq * d_model FLOPs each forward, times 3 for forward + backward. The causal mask is ignored
  (full cost counted), as in nanoGPT; softmax, norms, GELU and the optimizer are not counted.
* ``tokens = batch * seq``.

MFU is ``flops_per_step / step_seconds / peak``, where ``peak`` is the best rate of a large square
matmul in the same precision on this machine, measured by :func:`measure_peak`
(``python -m graphtrain.kernels.flops``: time-bounded, cached per machine), never a datasheet number. On CPU the fp32 peak is the better of
aten's ``a @ b`` (MKL) and oneDNN (graphtrain.kernels.gemm): on AMD CPUs MKL runs its AVX2 path at about
half of what the cores do with AVX-512, and a peak taken from it alone would put graphtrain's fp32 MFU
above 100%. Both rates are kept in the output (``fp32_aten``, ``fp32_onednn``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from graphtrain.kernels import capability
from graphtrain.kernels.gemm import gemm_onednn, onednn_fp32

# Substrings of parameter names that are embedding lookups without a matmul behind them.
_LOOKUP_ONLY = ("wpe", "position", "token_type", "segment")

PEAK_COMMAND = "python -m graphtrain.kernels.flops"

DEFAULT_SIZES = (512, 1024, 2048, 4096)
DEFAULT_BUDGET_S = 4.0
"""Seconds per dtype and library. Sizes grow while the next one is predicted to fit: on the AVX2 EPYC a bf16
matmul runs at ~1.4 GFLOP/s (emulated), so bf16 stops at 1024 there, where 4096^3 x 7 would take ~11 min."""
# NVIDIA's datasheet dense bf16 tensor-core peaks (FLOP/s, without 2:4 sparsity), by a piece of
# torch.cuda.get_device_name(), most specific first ("H100 PCIe" before "H100", "A100" before "A10", "L40S" before
# "L4"): the denominator of a GPU's MFU as the field quotes it (issue #48). A GPU not listed gets the measured peak.
DATASHEET_BF16 = (
    ("H200 NVL", 835e12),
    ("H200", 989.4e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989.4e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10", 125e12),
)


def datasheet_bf16(device_name: str) -> float | None:
    """The datasheet's dense bf16 peak of the GPU named `device_name`, or None when it is not in DATASHEET_BF16."""
    return next((flop for key, flop in DATASHEET_BF16 if key in device_name), None)


def mfu_peak(peak: dict[str, Any], precision: str) -> float | None:
    """The MFU denominator for `precision` in a measure_peak() result: a GPU's datasheet bf16 peak where known,
    else the measured matmul peak."""
    return peak.get(f"{precision}_datasheet") or peak.get(precision)


def step_flops(n_params: int, n_layer: int, seq: int, d_model: int, tokens: int) -> int:
    """Training FLOPs of one step (forward + backward), see the module docstring."""
    for name, v in (
        ("n_params", n_params),
        ("n_layer", n_layer),
        ("seq", seq),
        ("d_model", d_model),
        ("tokens", tokens),
    ):
        if v < 0:
            raise ValueError(f"{name} must be >= 0, got {v}")
    return (6 * n_params + 12 * n_layer * seq * d_model) * tokens


def matmul_params(model: Any) -> int:
    """Distinct trainable parameters minus lookup-only embeddings: positions, token types, and any nn.Embedding
    whose matrix no other module uses (an untied input embedding, as Llama's; a tied one is also the LM head's
    matmul and counts)."""
    import torch.nn as nn

    in_embedding: set[int] = set()
    elsewhere: set[int] = set()
    for module in model.modules():
        ids = {id(p) for p in module.parameters(recurse=False)}
        (in_embedding if isinstance(module, nn.Embedding) else elsewhere).update(ids)
    seen: set[int] = set()
    total = 0
    for name, p in model.named_parameters():  # named_parameters() already skips tied duplicates
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if any(s in name for s in _LOOKUP_ONLY) or (id(p) in in_embedding and id(p) not in elsewhere):
            continue
        total += p.numel()
    return total


def model_dims(model: Any) -> tuple[int, int]:
    """(n_layer, d_model) of a graphtrain reference model or a Hugging Face transformer."""
    for holder in ("spec", "config", "cfg"):
        cfg = getattr(model, holder, None)
        if cfg is None:
            continue
        layers = _first_attr(cfg, ("n_layer", "num_hidden_layers", "num_layers", "n_layers"))
        width = _first_attr(cfg, ("d_model", "n_embd", "hidden_size", "dim"))
        if layers and width:
            return int(layers), int(width)
    raise ValueError(f"cannot find n_layer / d_model on {type(model).__name__}: give it a `spec` or `config`")


def _first_attr(obj: Any, names: tuple[str, ...]) -> Any:
    for n in names:
        v = getattr(obj, n, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def mfu(flops: float, seconds: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation in [0, 1]-ish; None when the peak or the time is unknown."""
    if not peak_flops or not seconds or seconds <= 0:
        return None
    return flops / seconds / peak_flops


def measure_peak(
    sizes: tuple[int, ...] = DEFAULT_SIZES,
    repeats: int = 5,
    threads: int | None = None,
    device: str = "cpu",
    budget_s: float = DEFAULT_BUDGET_S,
) -> dict[str, Any]:
    """Best achieved FLOP/s of an n x n x n matmul in fp32 and bf16 (the MFU denominators), each dtype and
    library within `budget_s` seconds: sizes are tried smallest first and a size is skipped once its
    predicted time (at the best rate so far) no longer fits. The result says which sizes ran."""
    import os

    import torch

    torch.set_num_threads(threads or os.cpu_count() or 1)
    out: dict[str, Any] = {
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "device": device,
        "budget_s": budget_s,
        "command": PEAK_COMMAND,
        "sizes_run": {},
    }

    def best_rate(label: str, dtype: torch.dtype, mm: Any) -> float:
        best, spent, ran = 0.0, 0.0, []
        for n in sorted(sizes):
            flop = 2.0 * n**3
            if best and flop / best * (repeats + 2) > budget_s - spent:
                break  # the next size would not fit the budget
            g = torch.Generator(device="cpu").manual_seed(0)
            a = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
            b = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
            c = torch.empty(n, n, device=device, dtype=dtype)
            t_start = time.perf_counter()
            for i in range(repeats + 1):  # the first call warms up the GEMM path (oneDNN's kernel selection)
                _sync(device)
                t0 = time.perf_counter()
                mm(a, b, c)
                _sync(device)
                dt = time.perf_counter() - t0
                if i:
                    best = max(best, flop / dt)
                else:
                    best = max(best, flop / dt / 1.5)  # a floor for the size check until a timed call ran
                if time.perf_counter() - t_start > budget_s - spent:
                    break
            spent += time.perf_counter() - t_start
            ran.append(n)
        out["sizes_run"][label] = ran
        return best

    def aten_mm(a: Any, b: Any, c: Any) -> None:
        torch.mm(a, b, out=c)

    out["bf16"] = best_rate("bf16", torch.bfloat16, aten_mm)
    if device.startswith("cuda"):
        out["device_name"] = torch.cuda.get_device_name(torch.device(device))
        out["bf16_datasheet"] = datasheet_bf16(out["device_name"])
    out["fp32_aten"] = out["fp32"] = best_rate("fp32_aten", torch.float32, aten_mm)
    if device == "cpu":
        ok, why = onednn_fp32()
        if ok:
            out["fp32_onednn"] = best_rate("fp32_onednn", torch.float32, lambda a, b, c: gemm_onednn(a, b, out=c))
            out["fp32"] = max(out["fp32"], out["fp32_onednn"])
        else:
            out["fp32_onednn"] = None
            out["fp32_onednn_skipped"] = why
    return out


def machine_peak(device: str = "cpu", refresh: bool = False) -> dict[str, Any]:
    """measure_peak() with the defaults, measured once per machine and cached (kernels.capability.cached_probe);
    `refresh` measures again and replaces the cached figure."""
    if refresh:
        result = measure_peak(device=device)
        capability.store_probe(f"matmul_peak_{device}", result)
        return dict(result, cached=False)
    return capability.cached_probe(f"matmul_peak_{device}", lambda: measure_peak(device=device))


def ensure_machine_peak(device: str = "cpu", log: Any = print) -> None:
    """Measure this machine's peak once (machine_peak) unless any run measured it before; `graphtrain train` calls
    it so the MFU curve has its denominator. A failure is said and otherwise ignored (MFU is then not logged)."""
    if capability.peek_probe(f"matmul_peak_{device}", any_threads=True):
        return
    log("measuring this machine's matmul peak once, for MFU (cached: later runs skip this)")
    try:
        machine_peak(device)
    except Exception as e:  # noqa: BLE001 - MFU is a convenience; the run goes on without it
        log(f"could not measure the matmul peak ({type(e).__name__}: {e}); MFU is not logged")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Measure the fp32 and bf16 matmul peak (FLOP/s) as JSON. With no "
        "options the result is cached per machine; --refresh measures again."
    )
    p.add_argument("--sizes", type=int, nargs="+", default=None, help=f"square matmul sizes (default {DEFAULT_SIZES})")
    p.add_argument("--repeats", type=int, default=5, help="timed matmuls per size; the best one counts")
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds per dtype and library")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--refresh", action="store_true", help="measure again and replace the cached figure")
    a = p.parse_args(argv)
    custom = a.sizes is not None or a.repeats != 5 or a.budget != DEFAULT_BUDGET_S or a.threads is not None
    if custom:
        result = measure_peak(tuple(a.sizes or DEFAULT_SIZES), a.repeats, a.threads, a.device, a.budget)
    else:
        result = machine_peak(a.device, refresh=a.refresh)
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
