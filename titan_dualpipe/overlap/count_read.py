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
    local_counts: list[int]  # rows this rank sends to each expert, peer-major (on the host)
    received_counts: list[int]  # rows each peer sends to each local expert, peer-major (on the host)
    ep_size: int

    @property
    def input_splits(self) -> list[int]:
        """Rows this rank sends to each peer."""
        return _per_peer_on_host(self.local_counts, self.ep_size)

    @property
    def output_splits(self) -> list[int]:
        """Rows each peer sends to this rank."""
        return _per_peer_on_host(self.received_counts, self.ep_size)


def _per_peer_on_host(counts: list[int], ep_size: int) -> list[int]:
    per = len(counts) // ep_size
    return [sum(counts[peer * per:(peer + 1) * per]) for peer in range(ep_size)]


def read_token_counts(local: torch.Tensor, ep_size: int, post: Callable[[], torch.Tensor], group: Any) -> TokenCounts:
    """Post ``post()`` (the all-to-all of ``local``, this rank's per-expert counts, on ``group``, the
    count communicator) and read the splits on the host: on CUDA beside the compute stream
    (:func:`_read_beside_the_compute_stream`), on the CPU by the collective's wait."""
    if local.device.type == "cuda":
        return _read_beside_the_compute_stream(local, ep_size, post, group)
    received = count_exchange(post, group, read=wait_collective)
    return TokenCounts(received, local.reshape(-1).tolist(), received.reshape(-1).tolist(), ep_size)


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
    copy both sides' per-expert counts into pinned host memory without blocking; wait on the host for
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
            both = torch.cat([local.reshape(-1), received.reshape(-1)])
            host = _pinned_like(both)
            host.copy_(both, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(side)
        copied.synchronize()  # the host waits for this exchange and its copy only
        compute.wait_event(copied)
        _used_on(received, compute)
        return received, host.tolist()

    received, counts = count_exchange(post_on_side, group, read=read, hand_over_between=True)
    return TokenCounts(received, counts[:local.numel()], counts[local.numel():], ep_size)
