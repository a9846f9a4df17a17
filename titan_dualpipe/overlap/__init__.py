"""Overlapped forward+backward pairs: the protocol for stage modules and the pair runners."""

from .pair import run_pair_overlapped
from .protocol import OverlappedForwardBackward, overlap_implementation

__all__ = ["OverlappedForwardBackward", "overlap_implementation", "run_pair_overlapped"]
