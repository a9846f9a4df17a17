"""Overlapped forward+backward pairs.

- :mod:`.protocol`: how a stage module provides its own overlapped forward+backward.
- :mod:`.pair`: how the runtime runs a pair (overlapped by default, or sequentially).
- :mod:`.moe`, :mod:`.comm`, :mod:`.segments`: a ready MoE transformer stage module with
  expert-parallel all-to-all that implements the protocol, and the pieces it is built from.
"""

from .comm import EmulatedNetwork, ExpertParallelComm
from .moe import MoEArgs, MoETransformer, expert_parallel, split_parts
from .pair import run_pair_overlapped
from .protocol import OverlappedForwardBackward, overlap_implementation

__all__ = [
    "EmulatedNetwork",
    "ExpertParallelComm",
    "MoEArgs",
    "MoETransformer",
    "OverlappedForwardBackward",
    "expert_parallel",
    "overlap_implementation",
    "run_pair_overlapped",
    "split_parts",
]
