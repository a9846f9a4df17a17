"""The one place that touches torch's private pipelining names and their version differences, and
that wraps the private FSDP2, autograd, compile and c10d internals the package relies on.

The rest of the package never branches on the torch version: it imports torch's private names from
the module of their concern (``pipelining``, ``stage_init``, ``fsdp``, ``autograd``, ``compile``,
``c10d``: docs/architecture.md#layout); this file re-exports none of them. It holds the supported
torch range (:data:`SUPPORTED_TORCH`), checked at import.
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
