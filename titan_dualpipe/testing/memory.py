"""Live and peak bytes of CPU tensors, counted by a dispatch mode (tests and benchmarks)."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensorBytes(TorchDispatchMode):
    """Live and peak bytes of the CPU tensors created while active (storages counted once,
    released when torch frees them; views of an op's inputs, such as a weight's transpose, are
    no new storage)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._held: set[int] = set()

    def _release(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._held.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                key = _storage_key(t)
                if key and key not in self._held and key not in inputs:
                    storage = t.untyped_storage()
                    self._held.add(key)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._release, key, storage.nbytes())
        return out


def _storage_key(t: torch.Tensor) -> int:
    """The address of ``t``'s storage; 0 for a tensor with none of its own (a wrapper subclass,
    such as a functional collective's result, whose data lives in the tensor it wraps)."""
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:  # "invalid python storage"
        return 0
