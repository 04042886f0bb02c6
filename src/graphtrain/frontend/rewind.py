"""A module's state before a call, to run the call again from there (frontend/accelerate.py: a call whose capture
failed part-way is run again with its blocks inlined, or eagerly), and which calls need it: the first, and any
whose inputs differ in what Dynamo compiles for (a new shape, dtype or constant: a new variant to capture)."""

from __future__ import annotations

import torch
from torch import nn


class Rewind:
    """A module's buffers and the random streams as they were before a call, to run the call again from there:
    BatchNorm's running statistics and step count, dropout's draws. Parameters are left alone (a forward does not
    change them). Costs a copy of the buffers, taken on the calls `Signatures.new` names only."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.buffers = [(n, b, b.detach().clone()) for n, b in module.named_buffers()]
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def restore(self) -> None:
        with torch.no_grad():
            for name, buf, saved in self.buffers:
                owner_name, _, attr = name.rpartition(".")
                owner = self.module.get_submodule(owner_name)
                if owner._buffers.get(attr) is not buf:  # a forward that assigned a new tensor to the buffer
                    owner._buffers[attr] = buf
                buf.copy_(saved)
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)


class Signatures:
    """The calls' input signatures seen so far, to take a Rewind only before a call that may capture something new.

    Only a capture fails part-way, after graphs before it ran: a call with inputs shaped as an earlier call's runs
    the variants compiled then. A new shape, dtype or Python constant makes Dynamo compile a new variant somewhere
    in the call, possibly after graphs that ran already: past its recompile limit, a graph break's resume function
    refused its new variant after the graph before the break had updated a BatchNorm and drawn a dropout mask, and
    the eager re-run did both again (a later call's failure, which the first-call-only rewind missed). Not covered:
    a change Dynamo guards on that the inputs do not show (a hook added, a global flag)."""

    LIMIT = 256
    """Signatures kept at most; past it the set starts again (each call's rewind is then taken again once)."""

    def __init__(self) -> None:
        self.seen: set = set()

    @staticmethod
    def of(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
        leaves, spec = torch.utils._pytree.tree_flatten((args, kwargs))
        return (module.training, torch.is_grad_enabled(), str(spec), tuple(_leaf(x) for x in leaves))

    def new(self, sig: tuple) -> bool:
        return sig not in self.seen

    def add(self, sig: tuple) -> None:
        if len(self.seen) >= self.LIMIT:
            self.seen.clear()
        self.seen.add(sig)


def _leaf(x: object) -> object:
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), x.dtype, x.device, x.requires_grad)
    if x is None or isinstance(x, (bool, int, float, str)):
        return (type(x).__name__, x)
    return (type(x).__name__,)
