"""A module's state before a call, to run the call again from there (frontend/accelerate.py: a first call whose
capture failed part-way is run again with its blocks inlined, or eagerly)."""

from __future__ import annotations

import torch
from torch import nn


class Rewind:
    """A module's buffers and the random streams as they were before a call, to run the call again from there:
    BatchNorm's running statistics and step count, dropout's draws. Parameters are left alone (a forward does not
    change them). Costs a copy of the buffers, taken on the first call only."""

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
