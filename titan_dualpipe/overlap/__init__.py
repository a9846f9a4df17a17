"""Overlapped forward+backward pairs.

- :mod:`.protocol`: how a stage module provides its own overlapped forward+backward.
- :mod:`.pair`: how the runtime runs a pair (overlapped by default, or sequentially).
- :mod:`.sub_batches`: two-batch overlap, a lone action's microbatch as two relayed sub-batches.
- :mod:`.relay`: the overlap of modules without the protocol: the pair's halves as two
  threads that take turns at the module's exchanges (:func:`hand_over`).
- :mod:`.moe`, :mod:`.comm`, :mod:`.segments`: a ready MoE transformer stage module with
  expert-parallel all-to-all that implements the protocol, and the pieces it is built from.
"""

from .comm import EmulatedNetwork, ExpertParallelComm, relayed_all_to_all_single
from ..cut import cut_layers
from .moe import MoEArgs, MoETransformer, expert_parallel, set_exchange_chunks, split_parts
from .sub_batches import run_forward_in_sub_batches
from .pair import run_pair_overlapped
from .protocol import OverlappedForwardBackward, OverlappedSubBatches, overlap_implementation
from .relay import hand_over

__all__ = [
    "EmulatedNetwork",
    "ExpertParallelComm",
    "MoEArgs",
    "MoETransformer",
    "OverlappedForwardBackward",
    "OverlappedSubBatches",
    "cut_layers",
    "expert_parallel",
    "hand_over",
    "overlap_implementation",
    "relayed_all_to_all_single",
    "run_forward_in_sub_batches",
    "run_pair_overlapped",
    "set_exchange_chunks",
    "split_parts",  # deprecated: cut_layers
]


def __getattr__(name: str):
    if name == "OverlappedHalves":  # deprecated: warns and returns OverlappedSubBatches
        from . import protocol

        return protocol.__getattr__(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
