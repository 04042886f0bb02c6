"""What a run prints: a short start banner (the full config is the run folder's config.yaml, not the console's), a
progress bar when stderr is a terminal and plain periodic lines otherwise (a log file gets no carriage-return
redraws), numbers in the units people read (25.0k tok/s, 3 min 05 s), and other libraries quiet while graphtrain
writes exports (`quiet_libraries`): one line of graphtrain's own, not transformers' "Writing model shards" /
"Loading weights" bars, huggingface_hub's download bars, torch.onnx's step-by-step lines and registry warnings, or
deprecation warnings from inside those libraries. Errors still surface (logging stays at ERROR, exceptions
propagate); every setting is restored on the way out.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import torch


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def human(v: Any, unit: str = "") -> str:
    """A number as people read it: 25012.3 -> '25.0k', 1.53e9 -> '1.5G', 12.34 -> '12.3', 64 -> '64' (SI
    prefixes, one decimal); 'n/a' for None or NaN."""
    suffix = f" {unit}" if unit else ""
    if not _finite(v):
        return "n/a"
    if isinstance(v, int) and abs(v) < 1000:
        return f"{v}{suffix}"
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= scale:
            return f"{v / scale:.1f}{prefix}{suffix}"
    return (f"{v:.1f}" if abs(v) >= 1 or v == 0 else f"{v:.3g}") + suffix


def human_bytes(n: Any) -> str:
    """Bytes in binary units: 612429824 -> '584.1 MiB'."""
    if not _finite(n):
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_seconds(s: Any) -> str:
    """12.34 -> '12.3 s', 185 -> '3 min 05 s', 3725 -> '1 h 02 min'."""
    if not _finite(s):
        return "n/a"
    if s < 60:
        return f"{s:.1f} s"
    m, sec = divmod(int(round(s)), 60)
    return f"{m} min {sec:02d} s" if m < 60 else f"{m // 60} h {m % 60:02d} min"


def show_bar(progress: bool, is_main: bool, stream: TextIO | None = None) -> bool:
    """A live bar only where someone watches it: train.progress, the main rank, and stderr a terminal."""
    stream = sys.stderr if stream is None else stream
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        tty = False
    return bool(progress and is_main and tty)


def step_line(
    done: int, steps: int, loss: float, lr: float, tok_s: float, ms: float, mem: int | None, first: bool = False
) -> str:
    """The plain progress line printed every train.log_every steps when there is no bar. `first`: its window holds
    the session's first step (warm-up, graph capture and compilation), so its speed is not the run's."""
    return (
        f"step {done:>6}/{steps}  loss {loss:.4f}  lr {lr:.2e}  {human(tok_s, 'tok/s')}  {ms:.0f} ms/step  "
        f"peak mem {human_bytes(mem)}" + ("  (includes the first step: warm-up, capture, compile)" if first else "")
    )


def banner(
    config: Any,
    n_params: int,
    this_rank_only: bool,
    vocab_size: int,
    device: torch.device,
    env: Any,
    accelerated: bool,
    out_dir: Path,
) -> str:
    """The few lines a run starts with: model, data, device, engine and where everything is written."""
    tc, dc, par, ec = config.train, config.data, config.parallel, config.engine
    engine = (
        f"graphtrain engine (provider {ec.provider}, precision {ec.precision}, recompute {ec.recompute})"
        if accelerated
        else "eager PyTorch (train.accelerate=false"
        + (f", torch.autocast {ec.precision}" if ec.precision in ("bf16", "fp16") else "")
        + ")"
    )
    data = dc.path or "the Python standard library's source (data.path unset)"
    tokens = tc.batch_size * tc.grad_accum * dc.seq_len
    threads = torch.get_num_threads()
    where = f"{device}, {threads} thread{'s' if threads != 1 else ''}"
    if env is not None:
        where += (
            f" per rank, {env.world_size} ranks (pp {par.pp} x dp {par.dp} x tp {par.tp}"
            f"{', ZeRO-1' if par.zero_stage else ''})"
        )
    return "\n".join(
        [
            f"graphtrain: {config.model.label}, {n_params:,} params{' (this rank)' if this_rank_only else ''}; {engine}",
            f"  data:   {data}; seq_len {dc.seq_len}, vocab {vocab_size:,}",
            f"  steps:  {tc.steps:,} x {human(tokens)} tokens (batch {tc.batch_size} x grad_accum {tc.grad_accum}); "
            f"eval every {tc.eval_every or '-'}, checkpoint every {tc.ckpt_every or '-'}",
            f"  device: {where}",
            f"  out:    {out_dir} (full config: config.yaml; run info: run.json; metrics: metrics.jsonl)",
        ]
    )


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    restore = []
    if importlib.util.find_spec("transformers") is not None:
        from transformers.utils import logging as hf_logging

        verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        restore.append(
            lambda: (hf_logging.set_verbosity(verbosity), hf_logging.enable_progress_bar() if bars else None)
        )
    if importlib.util.find_spec("huggingface_hub") is not None:
        from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

        if not are_progress_bars_disabled():
            disable_progress_bars()
            restore.append(enable_progress_bars)
    onnx_log = logging.getLogger("torch.onnx")
    level = onnx_log.level
    onnx_log.setLevel(logging.ERROR)
    restore.append(lambda: onnx_log.setLevel(level))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            yield
    finally:
        for undo in reversed(restore):
            undo()
