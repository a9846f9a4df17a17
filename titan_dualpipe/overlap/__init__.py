"""Overlapped forward+backward pairs.

- :mod:`.protocol`: how a stage module provides its own overlapped forward+backward.
- :mod:`.pair`: how the runtime runs a pair (overlapped by default, or sequentially).
- :mod:`.two_batch`: two-batch overlap, a lone action's microbatch as two relayed halves.
- :mod:`.relay`: the overlap of modules without the protocol: the pair's halves as two
  threads that take turns at the module's exchanges (:func:`hand_over`).
- :mod:`.moe`, :mod:`.comm`, :mod:`.segments`: a ready MoE transformer stage module with
  expert-parallel all-to-all that implements the protocol, and the pieces it is built from.
"""

from .comm import EmulatedNetwork, ExpertParallelComm, relayed_all_to_all_single
from .moe import MoEArgs, MoETransformer, expert_parallel, split_parts
from .two_batch import run_forward_in_halves
from .pair import run_pair_overlapped
from .protocol import OverlappedForwardBackward, OverlappedHalves, overlap_implementation
from .relay import hand_over

__all__ = [
    "EmulatedNetwork",
    "ExpertParallelComm",
    "MoEArgs",
    "MoETransformer",
    "OverlappedForwardBackward",
    "OverlappedHalves",
    "expert_parallel",
    "hand_over",
    "overlap_implementation",
    "relayed_all_to_all_single",
    "run_forward_in_halves",
    "run_pair_overlapped",
    "split_parts",
]
