"""What graphtrain knows about its fused ops, in one place: a `KernelSpec` per kernel file and an `OpDescriptor`
per custom op it registers (forward, backward, seeded variant, seed draw).

Each kernel file ends with ``SPEC = register_kernel_spec(KernelSpec(..., ops=(OpDescriptor(...), ...)))``, beside
the ops it describes. The passes, the recompute partitioner, mixed precision, the memory predictor and the report
read these facts from here (`op_descriptor`) instead of keeping their own lists of graphtrain ops, so adding a
fused op is one kernel file (with its descriptors) plus one fusion pass. Every descriptor field is required;
tests/test_op_registry.py fails for a graphtrain op the dispatcher knows that has no descriptor.

Ops that belong to no kernel (the tensor-parallel collectives) register their descriptors with `register_ops`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

# --- the descriptor's vocabularies -------------------------------------------------------------------------

# role: what the op is to its kernel
FORWARD = "forward"  # what a fusion pass inserts (the public functional calls it too)
BACKWARD = "backward"  # what the forward's autograd rule calls
SEEDED = "seeded"  # a random forward op (returning (out, seed)) for a given seed: (*its inputs, seed) -> out
SEED = "seed"  # draws that seed: (salt: int) -> int64 [1]; memory/seeded.py splits the forward in two
COLLECTIVE = "collective"  # communication (tensor parallelism)
ROLES = (FORWARD, BACKWARD, SEEDED, SEED, COLLECTIVE)

# recompute: what re-running the op in the backward costs (memory/recompute.py)
CHEAP = "cheap"  # like a pointwise op or a norm: selective recompute may re-run it
REDUCTION = "reduction"  # like an ATen reduction: re-run only inside a checkpointed layer (full)
COMPUTE_BOUND = "compute-bound"  # like a matmul: saved, except inside a checkpointed layer (full)
NEVER = "never"  # always saved (as an op without a descriptor would be)
RECOMPUTE = (CHEAP, REDUCTION, COMPUTE_BOUND, NEVER)

# precision: what mixed precision does with the op (passes/mixed_precision.py)
LOW = "low"  # compute in bf16/fp16: fp32 inputs are cast down
FP32 = "fp32"  # compute in fp32: low-precision inputs are cast up
FOLLOW = "follow"  # type promotion: low only when every floating input already is
PRECISIONS = (LOW, FP32, FOLLOW)


def hint_int(x: Any) -> int:
    """An int without guarding: a SymInt (dynamic shapes) gives its size hint, never a new guard (``int()``
    on a SymInt would specialize the compiled graph to the example's size)."""
    if isinstance(x, torch.SymInt):
        h = getattr(x.node, "hint", None)
        return int(h) if h is not None else 0
    return int(x)


def no_workspace(node: fx.Node) -> int:
    """workspace_bytes of an op that allocates nothing beyond its outputs."""
    return 0


def input_value(node: fx.Node, i: int) -> Any:
    """The fake value (meta["val"]) of the op's i-th positional input at `node`, a node of the graph: what a
    workspace_bytes function reads the input's shape, dtype and device from."""
    a = node.args[i]
    if not isinstance(a, fx.Node):
        raise TypeError(f"{node.format_node()}: argument {i} is not a value of the graph")
    return a.meta["val"]


@dataclass(frozen=True)
class OpDescriptor:
    """The facts about one graphtrain custom op that code outside its kernel needs. No field has a default."""

    name: str
    """The op is ``torch.ops.graphtrain.<name>``."""
    role: str
    """forward | backward | seeded | seed | collective (see ROLES)."""
    random: bool
    """Draws random numbers inside (its dropout seed). Its schema cannot say so, so without this the passes would
    merge two calls (CSE), and the partitioner could re-run it in the backward with a new seed."""
    recompute: str
    """cheap | reduction | compute-bound | never: what the recompute partitioner may do with it (random ops are
    never recomputed, whatever this says)."""
    precision: str
    """low | fp32 | follow: what the mixed-precision pass does with it."""
    workspace_bytes: Callable[[fx.Node], int]
    """Scratch bytes the op allocates and frees inside itself, from its node's fake inputs (the memory predictor
    adds them at the node; the graph only shows the outputs). `no_workspace` for none."""
    cpp: tuple[str, ...]
    """The _cpu_ext functions its CPU path calls, directly or through gemm.matmul (empty: none)."""

    def __post_init__(self) -> None:
        for field_name, value, allowed in (
            ("role", self.role, ROLES),
            ("recompute", self.recompute, RECOMPUTE),
            ("precision", self.precision, PRECISIONS),
        ):
            if value not in allowed:
                raise ValueError(f"graphtrain::{self.name}: {field_name} must be one of {allowed}, got {value!r}")
        if not isinstance(self.random, bool) or not callable(self.workspace_bytes):
            raise TypeError(f"graphtrain::{self.name}: random must be a bool and workspace_bytes a function")
        if not isinstance(self.cpp, tuple) or not all(isinstance(c, str) for c in self.cpp):
            raise TypeError(f"graphtrain::{self.name}: cpp must be a tuple of _cpu_ext function names")

    @property
    def op(self) -> torch._ops.OpOverloadPacket:
        return getattr(torch.ops.graphtrain, self.name)


@dataclass
class KernelSpec:
    """One fused op's kernel file: its public functional, reference, which implementation serves each device,
    and the descriptors of the custom ops it registers."""

    name: str
    functional: Callable
    reference: Callable
    implementations: dict[str, str]
    checkers: dict[str, Callable[..., bool]]
    """device -> checker(*args) -> True if that device's fast path takes these inputs"""
    ops: tuple[OpDescriptor, ...]

    @property
    def op(self):
        return getattr(torch.ops.graphtrain, self.name)

    def implementation_for(self, device: str, *args) -> str:
        chk = self.checkers.get(device)
        if chk is not None and chk(*args):
            return self.implementations[device]
        return "reference"

    def op_with_role(self, role: str) -> OpDescriptor | None:
        return next((d for d in self.ops if d.role == role), None)


KERNELS: dict[str, KernelSpec] = {}
OPS: dict[str, OpDescriptor] = {}
_OWNER: dict[str, str] = {}  # op name -> the kernel (or module) that registered its descriptor


def register_ops(*descriptors: OpDescriptor, owner: str) -> None:
    """Register descriptors of graphtrain ops; `owner` names the kernel or module they belong to."""
    for d in descriptors:
        assert _OWNER.get(d.name, owner) == owner, f"graphtrain::{d.name} described by {_OWNER[d.name]} and {owner}"
        OPS[d.name] = d
        _OWNER[d.name] = owner


def register_kernel_spec(spec: KernelSpec) -> KernelSpec:
    assert spec.name not in KERNELS or KERNELS[spec.name].functional is spec.functional, spec.name
    forward = spec.op_with_role(FORWARD)
    assert forward is not None and forward.name == spec.name, spec.name
    KERNELS[spec.name] = spec
    register_ops(*spec.ops, owner=spec.name)
    return spec


def op_descriptor(op: Any) -> OpDescriptor | None:
    """The descriptor of a graphtrain op (an OpOverload such as a node's target, an OpOverloadPacket,
    "graphtrain::name" or "name"); None for any other op (aten, other libraries, Python functions)."""
    if isinstance(op, torch._ops.OpOverload):
        qualified = op._schema.name
    elif isinstance(op, torch._ops.OpOverloadPacket):
        qualified = op._qualified_op_name
    elif isinstance(op, str):
        qualified = op if "::" in op else f"graphtrain::{op}"
    else:
        return None
    namespace, _, name = qualified.partition("::")
    return OPS.get(name) if namespace == "graphtrain" else None


def is_random_op(op: Any) -> bool:
    """Draws random numbers: an op tagged nondeterministic_seeded (ATen's dropout, bernoulli, rand, ...;
    graphtrain::dropout_seed) or a graphtrain op whose descriptor says so (it draws its seed inside)."""
    if not isinstance(op, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded in op.tags:
        return True
    d = op_descriptor(op)
    return d is not None and d.random


def dispatcher_graphtrain_ops() -> list[str]:
    """Names of every graphtrain:: op the dispatcher knows in this process (made by torch.library)."""
    return sorted(n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("graphtrain::"))
