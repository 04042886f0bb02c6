"""The persistent compile cache: Inductor's FX-graph cache and AOTAutograd cache under one folder.

Root: ``engine.cache_dir``, else ``$GRAPHTRAIN_CACHE/compile``, else ``~/.cache/graphtrain/compile``.
Inductor reads ``TORCHINDUCTOR_CACHE_DIR`` on every lookup, so pointing it there before the first compile
sends the FX-graph cache, the AOTAutograd cache and the generated C++/Triton kernels to our folder. A
user who set ``TORCHINDUCTOR_CACHE_DIR`` to a folder of their own keeps it (we never override an explicit
choice). torch itself writes its default folder into that variable when ``torch._dynamo`` is imported
(torch 2.13: torch/_dynamo/package.py), so a value equal to torch's default counts as unset; before
that check the engine's ``cache_dir`` was silently ignored.

Custom passes stay cache-safe because the provider hands them to Inductor as a ``CustomGraphPass`` whose
``uuid()`` hashes the pass sources and the enabled pass list (see providers.py); a changed pass or config
gives a new key instead of a stale hit.
"""
from __future__ import annotations

import os
from pathlib import Path

from graphtrain.config import EngineConfig


def cache_root(config: EngineConfig) -> Path:
    if config.cache_dir:
        return Path(config.cache_dir).expanduser()
    env = os.environ.get("GRAPHTRAIN_CACHE")
    if env:
        return Path(env).expanduser() / "compile"
    return Path.home() / ".cache" / "graphtrain" / "compile"


def configure_cache(config: EngineConfig) -> Path:
    """Point Inductor's on-disk caches at graphtrain's cache folder and switch them on; returns the folder."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    root = cache_root(config)
    if not _user_set_inductor_cache() or os.environ.get("_GRAPHTRAIN_SET_CACHE") == "1":
        root.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root)
        os.environ["_GRAPHTRAIN_SET_CACHE"] = "1"
    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])


def _user_set_inductor_cache() -> bool:
    """Whether TORCHINDUCTOR_CACHE_DIR names a folder other than the default torch fills in itself."""
    value = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not value:
        return False
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    return os.path.abspath(value) != os.path.abspath(default_cache_dir())
