"""The host's read of an expert-parallel token-count exchange.

A dispatch cannot post its token exchange before the host knows how many rows it sends to and
receives from each peer. torchtitan reads the received counts with a blocking copy on the compute
stream: on a GPU the host then waits for every kernel queued there before the copy (in a relayed
pair, the partner half's too) and launches nothing meanwhile. :func:`read_token_counts` instead
reads them beside the compute stream on CUDA, handing over to the partner half while the counts
travel. On the CPU the read is the collective's wait, with no hand-over: there the partner's turn
is its compute itself, and handing over only moved the wait to the partner (``bench titan``'s
``... counts handed over`` variants). docs/overlap.md#in-torchtitan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from .._compat.c10d import wait_collective
from .comm import count_exchange


@dataclass(frozen=True)
class TokenCounts:
    """A count exchange, read: what the dispatch needs on the device and on the host."""

    received: torch.Tensor  # the counts the peers sent, as the exchange returns them, arrived
    input_splits: list[int]  # rows this rank sends to each peer
    output_splits: list[int]  # rows each peer sends to this rank


def per_peer(counts: torch.Tensor, ep_size: int) -> torch.Tensor:
    """Per-expert token counts summed over each peer's experts."""
    return counts.reshape(ep_size, -1).sum(dim=1)


def read_token_counts(local: torch.Tensor, ep_size: int, post: Callable[[], torch.Tensor], group: Any) -> TokenCounts:
    """Post ``post()`` (the all-to-all of ``local``, this rank's per-expert counts, on ``group``, the
    count communicator) and read the splits on the host: on CUDA beside the compute stream
    (:func:`_read_beside_the_compute_stream`), on the CPU by the collective's wait."""
    if local.device.type == "cuda":
        return _read_beside_the_compute_stream(local, ep_size, post, group)
    received = count_exchange(post, group, read=wait_collective)
    return TokenCounts(received, per_peer(local, ep_size).tolist(), per_peer(received, ep_size).tolist())


_SIDE_STREAMS: dict[torch.device, Any] = {}


def _side_stream(device: torch.device) -> Any:
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


def _pinned_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)


def _used_on(t: torch.Tensor, stream: Any) -> None:
    """Tell the caching allocator that ``t`` (made on another stream) is used on ``stream``."""
    t.record_stream(stream)


def _read_beside_the_compute_stream(local: torch.Tensor, ep_size: int, post: Callable[[], torch.Tensor],
                                    group: Any) -> TokenCounts:
    """Post the exchange from a side stream once the local counts are computed; hand over to the
    partner half while the counts travel (its turn only launches kernels, which queue on the
    compute stream behind nothing of this exchange); on the side stream, wait for the exchange and
    copy both sides' per-peer sums into pinned host memory without blocking; wait on the host for
    that copy's event alone, and make the compute stream wait for it before it uses the counts."""
    compute, side = torch.cuda.current_stream(local.device), _side_stream(local.device)
    side.wait_stream(compute)  # the local counts are computed on the compute stream
    _used_on(local, side)

    def post_on_side() -> torch.Tensor:
        with torch.cuda.stream(side):
            return post()

    def read(posted: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        with torch.cuda.stream(side):
            received = wait_collective(posted)  # the side stream waits for the exchange
            sums = torch.cat([per_peer(local, ep_size), per_peer(received, ep_size)])
            host = _pinned_like(sums)
            host.copy_(sums, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(side)
        copied.synchronize()  # the host waits for this exchange and its copy only
        compute.wait_event(copied)
        _used_on(received, compute)
        return received, host.tolist()

    received, sums = count_exchange(post_on_side, group, read=read, hand_over_between=True)
    return TokenCounts(received, sums[:ep_size], sums[ep_size:])
