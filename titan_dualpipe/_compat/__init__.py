"""The one place that touches torch's private pipelining names and their version differences, and
that wraps the private FSDP2, autograd, compile and c10d internals the package relies on.

The rest of the package never branches on the torch version: what differs across the supported
range is adapted in the modules below, and the package imports torch's private names from them,
each from the module of its concern (this file re-exports none of them):

- ``pipelining``: torch's pipelining IR and runtime (actions, lowering passes, p2p, stage
  classes, split backward), and the flags of the torch problems we work around
- ``stage_init``: stage initialisation per release (metadata inference, warm-up messages)
- ``fsdp``: FSDP2's parameter groups and post-forward, composable DDP ``replicate``
- ``autograd``: autograd and thread state (private thread-local state, backward detection,
  checkpoint regions seen, a module's forward replaced)
- ``compile``: ``torch.compile``'s backends and donated buffers
- ``c10d``: functional collectives, the default store, C++ stacks on a fatal signal

This file holds the supported torch range (:data:`SUPPORTED_TORCH`), checked at import.
"""

from __future__ import annotations

import torch

SUPPORTED_TORCH = (">=2.11", "<2.16")
_SUPPORTED_MINORS = ((2, 11), (2, 15))  # inclusive bounds of SUPPORTED_TORCH


def torch_version(version: str | None = None) -> tuple[int, int]:
    """``(major, minor)`` of ``version`` (default: the running torch)."""
    major, minor = (int(p) for p in (version or torch.__version__).split("+")[0].split(".")[:2])
    return major, minor


def check_torch_version(version: str | None = None) -> None:
    """ImportError naming the supported range unless ``version`` (default: the running torch) is in it."""
    found = version or torch.__version__
    low, high = _SUPPORTED_MINORS
    if not low <= torch_version(found) <= high:
        raise ImportError(
            f"titan_dualpipe supports torch {','.join(SUPPORTED_TORCH)} (2.11 to 2.15; it builds on "
            f"torch's private pipelining runtime, adapted per version); found torch {found}. "
            "Install a torch in that range, e.g. pip install 'torch>=2.11,<2.16'."
        )


check_torch_version()
TORCH_VERSION = torch_version()

__all__ = ["SUPPORTED_TORCH", "TORCH_VERSION", "check_torch_version", "torch_version"]
