"""graphtrain: faster, leaner PyTorch training by treating the training step as one static graph.

Public API::

    model = graphtrain.accelerate(model)            # drop-in module, trains through the graph engine
    torch.compile(model, backend="graphtrain")      # or as a torch.compile backend
    graphtrain.wait_compiled(model)                 # provider auto: wait for the background Inductor compile
    print(graphtrain.report(model))                 # what was captured, fused, recomputed, and why
    print(graphtrain.bisect(make_model, batch))     # the first pass/fused op/provider that leaves eager's tolerance
    step = graphtrain.compile_step(model, config)   # forward+backward+clip+AdamW compiled; step(**batch)
    graphtrain.Trainer(graphtrain.Config()).fit()   # the trainer behind `graphtrain train`
"""

from __future__ import annotations

from typing import Any

from graphtrain.config.torch_range import check_installed_torch

check_installed_torch()  # first: an unsupported torch stops here, naming the range (without importing torch)

from graphtrain.config.sections import (  # noqa: E402
    Config,
    DataConfig,
    EngineConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
)

# Imports inside functions: import cost: `import graphtrain` stays light; each public name loads its module on first
# use.

__version__ = "0.1.0"

# Heavier pieces load on first use so `import graphtrain` stays fast.
_LAZY = {
    "accelerate": "graphtrain.frontend.accelerate",
    "wait_compiled": "graphtrain.frontend.accelerate",
    "report": "graphtrain.tools.report",
    "bisect": "graphtrain.tools.bisect",
    "compile_step": "graphtrain.frontend.compile_step",
    "Trainer": "graphtrain.trainer.trainer",
}

__all__ = [
    "Config",
    "DataConfig",
    "EngineConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "TrainConfig",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'graphtrain' has no attribute {name!r}")


def _register_backend() -> None:
    """Make ``torch.compile(model, backend="graphtrain")`` work.

    An installed graphtrain is found through its ``torch_dynamo_backends`` entry point, which Dynamo reads when it
    first looks a backend name up; importing Dynamo here to register it would cost every ``import graphtrain``
    about 1.4 s and 140 MB of resident memory (sympy, Dynamo, Triton's front end), eager processes included. A
    checkout used without installing it (PYTHONPATH) has no entry point: then, or when Dynamo is loaded already,
    the backend is registered directly."""
    import sys

    if "torch._dynamo" not in sys.modules:
        from importlib import metadata

        try:
            if any(
                ep.name == "graphtrain" and ep.group == "torch_dynamo_backends"
                for ep in metadata.distribution("graphtrain").entry_points
            ):
                return
        except metadata.PackageNotFoundError:
            pass
    try:
        from graphtrain.runtime.backend import register_backend
    except ImportError:  # engine not built yet in this checkout
        return
    register_backend()


_register_backend()
