"""The persistent compile cache: Inductor's FX-graph cache, AOTAutograd cache and graphtrain's pass results under
one folder.

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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from graphtrain.config.sections import EngineConfig
from graphtrain.config.torch_compat import allow_retained_backward
from graphtrain.kernels import capabilities
from graphtrain.passes.graph_utils import digest_graph_into
from graphtrain.passes.manager import STAGES, pipeline
from graphtrain.pipeline.graph_data import symbolic_inputs

if TYPE_CHECKING:
    import torch.fx as fx


def cache_root(config: EngineConfig) -> Path:
    if config.cache_dir:
        return Path(config.cache_dir).expanduser()
    env = os.environ.get("GRAPHTRAIN_CACHE")
    if env:
        return Path(env).expanduser() / "compile"
    return Path.home() / ".cache" / "graphtrain" / "compile"


def configure_cache(config: EngineConfig) -> Path:
    """Point Inductor's on-disk caches at graphtrain's cache folder and switch them on; returns the folder. Every
    entry point calls it before its first compile, so it also sets the other process-wide compile setting
    graphtrain needs: no donated buffers (config/torch_compat.py allow_retained_backward), which AOTAutograd's cache
    keys include."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    allow_retained_backward()

    root = cache_root(config)
    if not user_set_inductor_cache() or os.environ.get("_GRAPHTRAIN_SET_CACHE") == "1":
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a usage error naming the setting (an OSError read as a failed run to --resume)
            key = (
                "$GRAPHTRAIN_CACHE (or engine.cache_dir)"
                if not config.cache_dir and os.environ.get("GRAPHTRAIN_CACHE")
                else "engine.cache_dir"
            )
            raise ValueError(
                f"{key} {str(root)!r} cannot be used as the compile cache ({e.strerror or e}): point "
                f"{key} at a folder you can write"
            ) from None
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root)
        os.environ["_GRAPHTRAIN_SET_CACHE"] = "1"
    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])


def user_set_inductor_cache(env: Mapping[str, str] | None = None) -> bool:
    """Whether TORCHINDUCTOR_CACHE_DIR (in `env`, default this process's) names a folder other than the default
    torch fills in itself (torch's `cache_dir()` writes the default into os.environ the first time it runs)."""
    value = (os.environ if env is None else env).get("TORCHINDUCTOR_CACHE_DIR")
    if not value:
        return False
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.path.abspath(value) != os.path.abspath(default_cache_dir())


# ----------------------------------------------------------------------- graphtrain's pass results --
# Inductor's caches start after our pre-autodiff stage (their key is the graph our passes hand over), so a warm
# process would still trace every graph to aten and run every pass. We keep the optimized graph itself, keyed by
# everything that decides it: the Dynamo graph's code and constants, its inputs' metadata and kinds, the engine
# config, graphtrain's own source, torch's version and the machine's CPU capability. Hand-written because no
# torch cache covers a backend's own passes. The graph is stored node by node (_encode_graph): FX's own
# GraphModule pickle re-traces the generated code on load, which runs every op that takes no graph input (a
# dropout's `empty`/`bernoulli`, an `arange`) and bakes its result in as a constant (measured: a dropout mask
# frozen into the graph).

_SOURCE_DIGEST: str | None = None
PASS_CACHE_VERSION = 2


_SOURCES = (
    "passes",
    "kernels",
    "frontend",
    "runtime",
    "pipeline",
    "memory",
    "config/sections.py",
    "config/fallback.py",
)
"""What a pre-autodiff result depends on: the passes, the kernels they insert (and their descriptors), the
tracing pipeline, the providers and entry points that run it, and the config. The trainer, CLI, models and
data do not (a model's own change shows in its Dynamo graph, which is in the key)."""


def _source_files(folder: Path) -> list[Path]:
    """The Python and the C++ (kernels/csrc/*.cpp, *.h) under `folder`."""
    return [p for ext in ("*.py", "*.cpp", "*.h") for p in folder.rglob(ext)]


def source_digest() -> str:
    """sha256 over the sources in _SOURCES: any change to a pass, kernel or the pipeline is a new key."""
    global _SOURCE_DIGEST
    if _SOURCE_DIGEST is None:
        import hashlib

        root = Path(__file__).resolve().parent.parent
        h = hashlib.sha256()
        files = [
            p for name in _SOURCES for p in (_source_files(root / name) if (root / name).is_dir() else [root / name])
        ]
        for path in sorted(files):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
        _SOURCE_DIGEST = h.hexdigest()
    return _SOURCE_DIGEST


def pass_cache_key(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    kinds: Sequence[str],
    config: EngineConfig,
    inference: bool = False,
) -> str:
    """The key of `gm`'s pre-autodiff result under `config` (a hex digest). `inference`: the graph is compiled under
    no_grad (GraphRecord.inference), where passes may differ (loss_only_lm_head); a training graph's key is as
    before."""
    import dataclasses
    import hashlib
    import platform

    import torch

    h = hashlib.sha256()
    h.update(
        f"v{PASS_CACHE_VERSION} torch {torch.__version__} {platform.machine()} "
        f"{torch.backends.cpu.get_cpu_capability()} {source_digest()}\n".encode()
    )
    h.update(_machine_and_passes(config).encode())
    # the ambient autocast state: Dynamo leaves an autocast entered outside the compiled region out of the graph's
    # code, and the trace applies it, so one graph's fp32 and bf16-autocast results differ by this alone (a bf16 run
    # after an fp32 one on one cache crashed on mixed dtypes; the reverse order silently trained the bf16 graph)
    for device in ("cpu", "cuda"):
        h.update(f"autocast {device} {torch.is_autocast_enabled(device)} {torch.get_autocast_dtype(device)}\n".encode())
    if inference:
        h.update(b"inference\n")
    digest_graph_into(h, gm)
    for x, kind in zip(symbolic_inputs(gm, example_inputs), kinds):  # sizes as Dynamo traced them: s27, not 128
        if isinstance(x, torch.Tensor):
            h.update(f"{kind} {tuple(x.shape)} {x.stride()} {x.dtype} {x.device.type} {x.requires_grad}\n".encode())
        else:
            h.update(f"{kind} {type(x).__name__} {x!r}\n".encode())
    # where, when and how loudly, not what is compiled (a fallback a cached result recorded is replayed under the
    # policy in force: _cached_passes)
    unkeyed = ("cache_dir", "debug", "compile_in_background", "background_at_exit", "background_timeout", "fallback")
    settings = {k: v for k, v in dataclasses.asdict(config).items() if k not in unkeyed}
    h.update(repr(sorted(settings.items())).encode())
    return h.hexdigest()


def _machine_and_passes(config: EngineConfig) -> str:
    """What else decides a pass result: the kernel library each capability picked (a simulated smaller CPU
    included), and the code of every pass the pipeline runs (a pass replaced at run time, as tests do, is a
    different pass), the dynamo stage's included: the key is taken before hide_autograd_functions runs."""
    import hashlib

    # cpu_fp32_gemm is left out: its text changes once the kernels' GEMM probe ran in this process, and the pass
    # that rewrites GEMMs decides from per-shape probes kept per machine (gemm.shape_probe), not from it
    caps = {k: v for k, v in capabilities().items() if k not in ("runtime_fallbacks", "cpp_kernels", "cpu_fp32_gemm")}
    h = hashlib.sha256(repr(sorted(caps.items())).encode())
    for stage in STAGES:
        for spec in pipeline(stage, config):
            code = getattr(spec.fn, "__code__", None)
            h.update(f"{stage}:{spec.name}:{getattr(spec.fn, '__qualname__', '')}".encode())
            h.update(code.co_code if code is not None else repr(spec.fn).encode())
    return h.hexdigest()


# A pass result is a pickle (graph nodes, tensors, pass records), and `engine.cache_dir` can name any folder (a job
# file sets it): a planted file there once ran its code on load. Each file carries an HMAC-SHA256 of its bytes under
# a key only this user can read (`_user_key`, outside every cache folder); a file whose tag does not verify is never
# unpickled: it counts as absent, the graph is traced again and the entry rewritten. (Inductor's own caches in the
# same folder are torch's pickles, which graphtrain does not read: docs/design/reliability.md.)
_MAGIC = b"graphtrain-pass-cache-hmac-sha256\n"


def _user_key() -> bytes | None:
    """32 random bytes in ``$XDG_CONFIG_HOME/graphtrain/cache.key`` (``~/.config/...``), mode 0600, made on first
    use; None (the pass cache is off) when it cannot be made or is readable by others or owned by someone else."""
    import secrets
    import stat

    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    path = Path(base).expanduser() / "graphtrain" / "cache.key"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(32))
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            key = f.read()
    except OSError:
        return None
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IRWXG | stat.S_IRWXO) or len(key) != 32:
        return None
    return key


def _tag(key: bytes, data: bytes) -> bytes:
    import hashlib
    import hmac

    return hmac.new(key, data, hashlib.sha256).digest()


def load_pass_result(config: EngineConfig, key: str) -> tuple[fx.GraphModule, list[Any], int, int] | None:
    """(graph, pass records, ops captured, ops after) stored under `key`, or None (absent, unreadable, or not
    written by this user's graphtrain: then the graph is simply traced again). Nothing is unpickled before its
    HMAC verifies."""
    import hmac
    import pickle

    path = cache_root(config) / "passes" / f"{key}.pkl"
    secret = _user_key()
    if secret is None:
        return None
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    n = len(_MAGIC)
    if not blob.startswith(_MAGIC) or not hmac.compare_digest(blob[n : n + 32], _tag(secret, blob[n + 32 :])):
        return None
    try:
        encoded, records, ops_captured, ops_after = pickle.loads(blob[n + 32 :])  # noqa: S301 - verified above
        return _decode_graph(encoded), records, ops_captured, ops_after
    except Exception:  # noqa: BLE001 - a stale entry (an older graphtrain's classes): recompute and overwrite it
        return None


def save_pass_result(
    config: EngineConfig, key: str, gm: fx.GraphModule, records: list[Any], ops_captured: int, ops_after: int
) -> fx.GraphModule:
    """Store the optimized graph atomically (a reader never sees half a file), tagged (_user_key), and return the
    graph as a later process will load it: compile that one, so this process and the next hand Inductor the same
    graph and share its cache entries (a freshly traced graph and its pickled copy differ in node metadata, which
    Inductor's and AOTAutograd's keys see: measured, every entry missed once more). A graph that does not pickle is
    not cached and comes back as it is."""
    import pickle
    import tempfile

    folder = cache_root(config) / "passes"
    secret = _user_key()
    try:
        data = pickle.dumps((_encode_graph(gm), records, ops_captured, ops_after))
        loaded = _decode_graph(pickle.loads(data)[0])  # noqa: S301 - the bytes we just made
        if secret is None:
            return loaded
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(_MAGIC + _tag(secret, data) + data)
        os.replace(tmp, folder / f"{key}.pkl")
    except Exception:  # noqa: BLE001 - caching is an optimization; the compile goes on
        return gm
    return loaded


class _Graph:
    """A nested graph inside an encoded graph (what _encode_graph returns for it)."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data


class _Ref:
    """A node (by name) or a callable (by where it is defined) inside an encoded graph."""

    def __init__(self, kind: str, value: Any) -> None:
        self.kind, self.value = kind, value


def _encode_target(target: Any) -> Any:
    import torch

    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):
        where = _defining_module(target.namespace, target._opname)
        return _Ref("op", (target.namespace, target._opname, target._overloadname, where))
    if isinstance(target, torch._ops.OpOverloadPacket):
        ns, op = target._qualified_op_name.split("::")[0], target.__name__.split(".")[-1]
        return _Ref("packet", (ns, op, _defining_module(ns, op)))
    if isinstance(target, torch._ops.HigherOrderOperator):
        hop = target.name()
        if getattr(torch.ops.higher_order, hop, None) is target:
            return _Ref("hop", hop)
    module, name = getattr(target, "__module__", None), getattr(target, "__qualname__", None)
    if not module or not name or "<" in name:
        raise TypeError(f"cannot name {target!r}")
    for ref in (_Ref("py", (module, name)), _Ref("py", (module, getattr(target, "__name__", "")))):
        try:  # torch's C functions name a class torch does not export (torch._VariableFunctionsClass.embedding)
            if _decode_target(ref) is target:
                return ref
        except (ImportError, AttributeError):
            pass
    raise TypeError(f"cannot name {target!r}: {module}.{name} is not where it is found")


def _defining_module(namespace: str, name: str) -> str | None:
    """The module whose import registers custom op `namespace::name` (``torch.library.custom_op``), or None (torch's
    own ops, and ops defined otherwise). A graph decoded in a fresh process, the background compile's, imports it first: HF
    Mixtral's experts call ``transformers::grouped_mm_fallback``, which transformers registers in a module the
    compile process had not imported, so Inductor's candidate failed there ("no attribute 'grouped_mm_fallback'")."""
    from torch._library.custom_ops import OPDEFS

    opdef = OPDEFS.get(f"{namespace}::{name}")
    module = getattr(getattr(opdef, "_init_fn", None), "__module__", None)
    return module if isinstance(module, str) and module != "__main__" else None


def _decode_target(ref: Any) -> Any:
    import importlib

    import torch

    if not isinstance(ref, _Ref):
        return ref
    if ref.kind in ("op", "packet"):
        ns, op, *rest = ref.value
        where = rest[-1] if len(rest) == (2 if ref.kind == "op" else 1) else None
        if where and not hasattr(getattr(torch.ops, ns), op):
            importlib.import_module(where)  # registers the op, as in the process that encoded it
        packet = getattr(getattr(torch.ops, ns), op)
        return getattr(packet, rest[0]) if ref.kind == "op" else packet
    if ref.kind == "hop":
        return getattr(torch.ops.higher_order, ref.value)
    module, name = ref.value
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _encode_graph(gm: fx.GraphModule) -> dict[str, Any]:
    """`gm` as plain picklable data: each node's op, name, target and arguments (nodes by name), and what its
    get_attr nodes read: tensors, and graphs a node calls (an autograd.Function's forward and backward bodies,
    encoded the same way). Node metadata is not kept (AOTAutograd traces the graph again anyway)."""
    import torch
    import torch.fx as fx

    def ref(n: fx.Node) -> Any:
        return _Ref("node", n.name)

    def arg(a: Any) -> Any:
        return fx.node.map_arg(a, ref)

    nodes: list[tuple[Any, ...]] = []
    attrs: dict[str, Any] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            value = getattr(gm, str(n.target))
            if isinstance(value, fx.GraphModule):
                attrs[str(n.target)] = _Graph(_encode_graph(value))
            elif isinstance(value, torch.Tensor):
                attrs[str(n.target)] = value.detach().clone()
            else:
                raise TypeError(f"get_attr {n.target} is a {type(value).__name__}")
        nodes.append((n.op, n.name, _encode_target(n.target), arg(n.args), arg(n.kwargs), _kept_meta(n)))
    return {"nodes": nodes, "attrs": attrs}


def _kept_meta(n: fx.Node) -> dict[str, Any]:
    """The metadata later stages read: which module (layer) a node came from, for recompute's layer regions
    (memory/recompute.py), module types as names."""
    out: dict[str, Any] = {}
    stack = n.meta.get("nn_module_stack")
    if stack:
        out["nn_module_stack"] = {k: (str(path), getattr(t, "__qualname__", str(t))) for k, (path, t) in stack.items()}
    custom = n.meta.get("custom")
    if custom:
        out["custom"] = {k: v for k, v in custom.items() if isinstance(v, (str, int, float, bool))}
    return out


def _decode_graph(data: dict[str, Any]) -> fx.GraphModule:
    import torch.fx as fx

    graph = fx.Graph()
    env: dict[str, fx.Node] = {}

    def arg(a: Any) -> Any:
        if isinstance(a, _Ref):
            return env[a.value]
        if isinstance(a, (list, tuple)):
            return type(a)(arg(x) for x in a)
        if isinstance(a, dict):
            return {k: arg(v) for k, v in a.items()}
        if isinstance(a, slice):  # x[:, :n] under dynamic shapes: a slice whose stop is a size node
            return slice(arg(a.start), arg(a.stop), arg(a.step))
        return a

    for op, name, target, args, kwargs, meta in data["nodes"]:
        node = graph.create_node(op, _decode_target(target), arg(args), arg(kwargs), name=name)
        node.meta.update(meta)
        env[name] = node
    attrs = {k: _decode_graph(v.data) if isinstance(v, _Graph) else v for k, v in data["attrs"].items()}
    return fx.GraphModule(attrs, graph)  # a dict root: get_attr targets (dotted too) from it
