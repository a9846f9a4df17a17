"""FSDP2 helpers of the runtime: a stage module's FSDP modules, gathered together."""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule


def fsdp_modules(module: nn.Module) -> list[FSDPModule]:
    """``module`` and its submodules that FSDP2 manages, in module order."""
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def unshard_all(module: nn.Module) -> None:
    """Gather the parameters of every FSDP2 module in ``module`` (waits for them)."""
    for m in fsdp_modules(module):
        m.unshard()

