"""Other libraries quiet while graphtrain exports: the export prints one line of its own (what was written and how
well it reloads), not transformers' "Writing model shards" / "Loading weights" bars, huggingface_hub's download bars,
torch.onnx's step-by-step lines and registry warnings, or deprecation warnings from inside those libraries.

Errors still surface: logging stays at ERROR and exceptions propagate. Every setting is restored on the way out.
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import warnings
from typing import Iterator


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    restore = []
    if importlib.util.find_spec("transformers") is not None:
        from transformers.utils import logging as hf_logging
        verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        restore.append(lambda: (hf_logging.set_verbosity(verbosity),
                                hf_logging.enable_progress_bar() if bars else None))
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
