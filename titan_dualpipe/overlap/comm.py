"""Expert-parallel all-to-all: our MoE module's exchange, with an optional emulated network
cost, and :func:`relayed_all_to_all_single` for any module.

:func:`all_to_all` posts an autograd-aware asynchronous exchange (its backward: the reverse
exchange) and returns a :class:`PendingAllToAll` that the caller waits when it chooses. Every
exchange here calls :func:`~titan_dualpipe.overlap.relay.hand_over` between posting and a wait
that is not the caller's choice, so it flies behind the partner half of a relayed pair. For the
benchmarks, :class:`EmulatedNetwork` and :func:`emulate_relayed_exchanges` make exchanges cost
time, :class:`CommStats` adds up the time left exposed, and on the CPU a recording benchmark is
told of each post and wait. The emulated network: benchmarks/README.md#method; the relay and the floor:
docs/overlap.md#the-relay, docs/overlap.md#the-floor.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from .._compat.c10d import post_all_to_all_single, wait_collective
from ..exposure.record import recorder
from ..weights.in_flight import fill_before_wait
from .relay import hand_over

T = TypeVar("T")
logger = logging.getLogger("titan_dualpipe")


# What a recorder files the GPU's emulated exchanges under: their delays run one after another on one
# side stream, a "serial" queue (titan_dualpipe.exposure.floor).
GPU_DELAY_CHANNEL = "emulated network (GPU side stream)"


@dataclass(frozen=True)
class EmulatedNetwork:
    """Cost of one all-to-all: ``latency_s + remote_bytes / bandwidth_bytes_per_s``."""

    latency_s: float = 0.0
    bandwidth_bytes_per_s: float = math.inf

    def __post_init__(self) -> None:
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(f"latency_s must be a finite number >= 0, got {self.latency_s}")
        if not self.bandwidth_bytes_per_s > 0:
            raise ValueError(
                f"bandwidth_bytes_per_s must be > 0 (math.inf for no bandwidth cost), got {self.bandwidth_bytes_per_s}"
            )

    def seconds(self, remote_bytes: int) -> float:
        return self.latency_s + remote_bytes / self.bandwidth_bytes_per_s


@dataclass
class CommStats:
    """Exchanges posted and charged, and seconds spent blocked in their ``wait()`` (see
    :meth:`collect`). Fixed size in training: the GPU stalls are timed (two CUDA events per
    exchange, kept until :meth:`collect`) only when a benchmark sets ``timing``."""

    posted: int = 0
    charged_forward: int = 0  # exchanges that paid an emulated network's time, forward
    charged_backward: int = 0  # and their reverse exchanges in a backward
    charged_bytes: int = 0  # their remote bytes (two-batch sub-batches post twice as many exchanges, each half as large)
    waited_s: float = 0.0
    timing: bool = False  # time the compute stream's stalls on a GPU (a benchmark, which drains them)
    gpu_stalls: list = field(default_factory=list)  # (start, end) CUDA events around compute-stream waits

    def reset(self) -> None:
        self.posted, self.charged_forward, self.charged_backward, self.charged_bytes = 0, 0, 0, 0
        self.waited_s = 0.0
        self.gpu_stalls.clear()

    def charge(self, backward: bool, remote_bytes: int = 0) -> None:
        self.charged_bytes += remote_bytes
        if backward:
            self.charged_backward += 1
        else:
            self.charged_forward += 1

    def wait_until(self, ready_at: float, wait: Callable[[], T], count: bool = False) -> T:
        """``wait()``, then sleep until ``ready_at`` (``time.perf_counter`` seconds: an emulated
        network's end); the time blocked counts as exposed. ``count``: the wait is a token-count
        read (a benchmark's recorder files its lateness apart)."""
        record = recorder()
        device_marks = record is not None and not record.host_clock  # else the host's times are its marks
        marked = record.now() if device_marks else None
        start = time.perf_counter()
        result = wait()
        remaining = ready_at - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        end = time.perf_counter()
        self.waited_s += end - start
        if record is not None:  # late: past the emulated arrival, either in the collective's own wait
            # (a peer posting late) or, once it came in time, in the sleep (woken late: overslept)
            span = (marked, record.now()) if device_marks else (start, end)
            late = max(0.0, end - max(ready_at, start))
            overslept = max(0.0, end - ready_at) if remaining > 0 else 0.0
            record.waited(*span, late=late, overslept=overslept, count_late=late - overslept if count else 0.0)
        return result

    def collect(self) -> float:
        """``waited_s``, with the GPU stalls recorded so far added (synchronizes the GPU)."""
        if self.gpu_stalls:
            torch.cuda.synchronize()
            self.waited_s += sum(start.elapsed_time(end) for start, end in self.gpu_stalls) / 1e3
            self.gpu_stalls.clear()
        return self.waited_s


class GpuDelay:
    """An emulated network on one GPU: a sleep kernel on a side stream, calibrated once."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.cycles_per_s = self._calibrate()

    def _calibrate(self, cycles: int = 2_000_000) -> float:
        torch.cuda._sleep(1000)  # the first launch pays the setup
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        return cycles / (start.elapsed_time(end) / 1e3)

    def delay(self, seconds: float) -> torch.cuda.Stream:
        """Start ``seconds`` of network time after everything the current stream has queued;
        returns the side stream, on which whatever follows the delay must be queued."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(max(1, int(seconds * self.cycles_per_s)))
        return self.stream


class PendingAllToAll:
    """An exchange in flight; ``output`` holds the result once ``wait()`` returned."""

    def __init__(self, output: torch.Tensor, work: dist.Work | None, ready_at: float, stats: CommStats,
                 gpu_done: torch.cuda.Event | None = None) -> None:
        self.output = output
        self._work = work
        self._ready_at = ready_at
        self._stats = stats
        self._gpu_done = gpu_done  # the emulated network's delay (GPU)
        self._done = False

    @property
    def ready_at(self) -> float | None:
        """When the exchange arrives (``time.perf_counter()``) on the CPU; None on a GPU, where the
        host cannot tell."""
        return None if self.output.is_cuda else self._ready_at

    def wait(self) -> torch.Tensor:
        if self._done:
            return self.output
        if self.output.is_cuda:
            self._wait_on_gpu()
        else:
            self._stats.wait_until(self._ready_at, self._work.wait if self._work is not None else lambda: None)
        self._done = True
        return self.output

    def _wait_on_gpu(self) -> None:
        """The compute stream waits (the CPU does not); with ``stats.timing``, CUDA events time
        the stall (kept until ``collect()``, so only a benchmark that drains them asks); a
        benchmark's recorder gets the stall as its own marks (the device's clock)."""
        record = recorder()
        marked = record is not None and not record.host_clock  # a recorder on the device's clock
        if not (self._stats.timing or marked):
            self._stream_waits()
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self._stream_waits()
        end.record()
        if self._stats.timing:
            self._stats.gpu_stalls.append((start, end))
        if marked:  # the same stall, the same events
            record.waited(start, end)

    def _stream_waits(self) -> None:
        if self._gpu_done is not None:
            torch.cuda.current_stream().wait_event(self._gpu_done)
        if self._work is not None:
            self._work.wait()  # on the compute stream: the tensors it holds are released after it


@dataclass(eq=False)
class ExpertParallelComm:
    """The expert-parallel group of one rank (``None``: one rank, nothing to exchange).

    Share one instance between all stage modules of a rank: their exchanges then add
    up in one :class:`CommStats`.
    """

    group: dist.ProcessGroup | None = None
    network: EmulatedNetwork | None = None
    stats: CommStats = field(default_factory=CommStats)
    # The group size the emulated network charges for (None: this group's): on one rank, the bytes a
    # group of that size would send away, so that an exchange's cost grows with its size (chunks).
    charged_size: int | None = None
    _gpu_delay: GpuDelay | None = field(default=None, repr=False)

    @property
    def size(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return 0 if self.group is None else dist.get_rank(self.group)

    def post(self, x: torch.Tensor, backward: bool = False, after: PendingAllToAll | None = None) -> PendingAllToAll:
        """Start exchanging equal slices of ``x`` along dim 0 (slice ``i`` goes to rank ``i``);
        ``backward``: the reverse exchange of a backward (counted apart in ``stats``); ``after``:
        an exchange this one queues behind on the emulated network (the chunks of one cut exchange:
        it starts when that one has arrived, and pays its own latency; on a GPU every delay queues
        on one side stream anyway)."""
        if x.shape[0] != self.size:
            raise ValueError(f"all-to-all input needs dim 0 == group size {self.size}, got shape {tuple(x.shape)}")
        self.stats.posted += 1
        if x.is_meta:  # shape inference on meta tensors exchanges nothing
            return PendingAllToAll(x if self.group is None else torch.empty_like(x), None, 0.0, self.stats)
        if self.network is not None:
            self.stats.charge(backward, self._remote_bytes(x))
            if x.is_cuda:
                return self._post_emulated_on_gpu(x)
        # One rank keeps its data; the network's time (if any) passes all the same.
        delay = 0.0 if self.network is None else self.network.seconds(self._remote_bytes(x))
        if self.group is not None:
            x = x.contiguous()
        start = time.perf_counter()
        ready_at = max(start, after._ready_at) + delay if after is not None else start + delay
        # Exchanges fly on their own here (each its own sleep), the chunks of one exchange one after
        # another; the recorder gets a chunk's own time, so the floor stays a lower bound.
        _record_posted(delay, None)
        if self.group is None:
            return PendingAllToAll(x, None, ready_at, self.stats)
        output = torch.empty_like(x)
        work = dist.all_to_all_single(output, x, group=self.group, async_op=True)
        return PendingAllToAll(output, work, ready_at, self.stats)

    def _remote_bytes(self, x: torch.Tensor) -> int:
        size = self.charged_size or self.size
        return x.numel() * x.element_size() * (size - 1) // size

    def _post_emulated_on_gpu(self, x: torch.Tensor) -> PendingAllToAll:
        """The network's time as a sleep kernel on a side stream, then the real exchange (if
        any) queued behind it; with no group the data stays (one rank) and only the time passes."""
        assert self.network is not None
        if self._gpu_delay is None or self._gpu_delay.device != x.device:
            self._gpu_delay = GpuDelay(x.device)
        x = x.contiguous()  # queued before the side stream starts waiting on the compute stream
        seconds = self.network.seconds(self._remote_bytes(x))
        side = self._gpu_delay.delay(seconds)
        _record_posted(seconds, GPU_DELAY_CHANNEL)  # the delays queue one after another on one side stream
        if self.group is None:
            done = torch.cuda.Event()
            done.record(side)
            return PendingAllToAll(x, None, 0.0, self.stats, gpu_done=done)
        output = torch.empty_like(x)
        with torch.cuda.stream(side):  # NCCL's stream then waits for the delay
            work = dist.all_to_all_single(output, x, group=self.group, async_op=True)
        return PendingAllToAll(output, work, 0.0, self.stats)


class _AllToAll(torch.autograd.Function):
    """Forward: post the exchange (the handle goes to ``box``). Backward: the reverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: ExpertParallelComm, box: list,  # type: ignore[override]
                after: PendingAllToAll | None) -> torch.Tensor:
        ctx.comm = comm
        pending = comm.post(x, after=after)
        box.append(pending)
        return pending.output

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        pending = ctx.comm.post(grad.contiguous(), backward=True)
        hand_over(backward=True, ready_at=pending.ready_at)
        fill_before_wait(pending.ready_at)
        return pending.wait(), None, None, None


def all_to_all(x: torch.Tensor, comm: ExpertParallelComm, after: PendingAllToAll | None = None) -> PendingAllToAll:
    """Post an autograd-aware exchange of ``x`` (shape ``[group size, ...]``); wait before reading
    ``output``. ``after``: as :meth:`ExpertParallelComm.post`'s."""
    if comm.group is None and comm.network is None:
        return comm.post(x)  # identity at no cost, either way: no autograd node needed
    # With a network but no group, the node still charges the backward's exchange, as the
    # segment-wise backward (which posts directly) does.
    box: list[PendingAllToAll] = []
    output = _AllToAll.apply(x, comm, box, after)
    pending = box[0]
    pending.output = output  # the graph-connected tensor (same storage the exchange fills)
    return pending


class _RelayedAllToAllSingle(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_split_sizes, input_split_sizes, group):  # type: ignore[override]
        ctx.splits, ctx.group = (output_split_sizes, input_split_sizes), group
        return _exchange(x, output_split_sizes, input_split_sizes, group, backward=False)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        output_split_sizes, input_split_sizes = ctx.splits
        return (_exchange(grad.contiguous(), input_split_sizes, output_split_sizes, ctx.group, backward=True),
                None, None, None)


@dataclass
class RelayedExchangeCost:
    """Emulated network for :func:`relayed_all_to_all_single` and :func:`count_exchange`
    (CPU): a token exchange is ready ``seconds`` after it was posted at the earliest, a count
    exchange (a few integers) after the latency alone (:attr:`latency_s`); each not before every
    exchange posted earlier on its own communicator (one FIFO per process group, as NCCL runs a
    communicator's collectives in order on its stream). The token-count exchange has a
    communicator of its own (:mod:`.count_groups`), so it queues behind no token exchange.
    ``stats`` adds up the time spent blocked waiting for exchanges (posted to waited, the partner
    half's compute excluded)."""

    seconds: float = 0.0
    # Rows of a whole microbatch's token exchange. Set: an exchange of ``rows`` rows costs
    # ``seconds * (1/2 + 1/2 * rows / reference_rows)`` (half latency, half bandwidth, as ``bench
    # overlap`` calibrates), so the two sub-batches of a two-batch split pay one more latency, not
    # twice the bandwidth. None: every token exchange costs ``seconds``.
    reference_rows: int | None = None
    stats: CommStats = field(default_factory=CommStats)
    count_hand_over: bool = False  # True: hand over between posting a count exchange and reading it (comparison run)
    _group_ready_at: dict = field(default_factory=dict)

    def seconds_for(self, rows: int) -> float:
        if not self.reference_rows:
            return self.seconds
        return self.seconds * (0.5 + 0.5 * rows / self.reference_rows)

    @property
    def latency_s(self) -> float:
        """An exchange's cost without its rows: half of ``seconds`` once rows are modelled, else 0."""
        return self.seconds_for(0) if self.reference_rows else 0.0

    def ready_at(self, group: Any, earliest: float) -> float:
        """When an exchange posted on ``group`` now, ready at ``earliest`` on its own, is ready."""
        key = channel_of(group)
        ready = max(earliest, self._group_ready_at.get(key, 0.0))
        self._group_ready_at[key] = ready
        return ready


def channel_of(group: Any) -> Any:
    """The communicator an exchange on ``group`` queues on (its name; the object's id without one)."""
    return getattr(group, "group_name", id(group))


def _record_posted(seconds: float, channel: Any) -> None:
    """Tell a benchmark's exposure recorder (if any) that an exchange of ``seconds`` was just posted."""
    record = recorder()
    if record is not None:
        record.posted(seconds, channel)


_RELAYED_COST: RelayedExchangeCost | None = None


def emulate_relayed_exchanges(seconds: float | None) -> RelayedExchangeCost | None:
    """Make every :func:`relayed_all_to_all_single` of this process cost at least ``seconds``
    (0: no extra cost) and count the time left exposed; returns the cost with its stats.
    ``None`` turns both off."""
    global _RELAYED_COST
    if seconds is not None and not (seconds >= 0 and math.isfinite(seconds)):
        raise ValueError(f"seconds per exchange must be a finite number >= 0, got {seconds}")
    _RELAYED_COST = None if seconds is None else RelayedExchangeCost(seconds)
    return _RELAYED_COST


def _post(x: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int], group,
          not_before: float | None = None) -> tuple[torch.Tensor, float | None]:
    """Post the exchange of ``x``; returns it (to be waited) and, under the emulated network, when it
    arrives: in order behind the exchanges posted before it on its communicator, and flying from
    ``not_before`` at the earliest (None: no emulated network)."""
    cost, posted_at = _RELAYED_COST, time.perf_counter()
    posted = post_all_to_all_single(x, output_split_sizes, input_split_sizes, group)
    if cost is None:
        return posted, None
    start = posted_at if not_before is None else max(posted_at, not_before)
    ready_at = cost.ready_at(group, start + cost.seconds_for(x.shape[0]))
    _record_posted(cost.seconds_for(x.shape[0]), channel_of(group))
    return posted, ready_at


def _wait(posted: torch.Tensor, ready_at: float | None, backward: bool) -> torch.Tensor:
    """Hand over to the partner half of a relayed pair (it computes while the exchange flies), then
    wait for the exchange :func:`_post` posted."""
    hand_over(backward=backward, ready_at=ready_at)
    if backward:
        fill_before_wait(ready_at)
    cost = _RELAYED_COST
    if cost is None or ready_at is None:
        return wait_collective(posted)
    cost.stats.posted += 1
    return cost.stats.wait_until(ready_at, lambda: wait_collective(posted))


def _exchange(x: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int], group,
              backward: bool) -> torch.Tensor:
    return _wait(*_post(x, output_split_sizes, input_split_sizes, group), backward=backward)


def count_exchange(post: Callable[[], T], group: Any, read: Callable[[T], Any], hand_over_between: bool = False) -> Any:
    """``read(post())``: an expert-parallel token-count exchange on ``group`` (its own
    communicator), posted, then read on the host (:mod:`.count_read`). ``hand_over_between``:
    hand over to the partner half between the two (as the CUDA read does), as does a comparison
    run's ``count_hand_over``.

    Under the emulated network the exchange is ready after the latency, and no earlier than the
    exchanges posted before it on ``group``; the read's wait for it, however the read blocks (the
    collective's wait on the CPU, a copy's event on a GPU), counts as exposed."""
    cost = _RELAYED_COST
    posted = post()
    ready_at = None if cost is None else cost.ready_at(group, time.perf_counter() + cost.latency_s)
    if cost is not None:  # read at once unless handed over (its switch)
        _record_posted(cost.latency_s, channel_of(group))
    if hand_over_between or (cost is not None and cost.count_hand_over):
        hand_over(ready_at=ready_at)
    if cost is None:
        return read(posted)
    return cost.stats.wait_until(ready_at, lambda: read(posted), count=True)


def relayed_all_to_all_single(
    x: torch.Tensor,
    output_split_sizes: list[int] | None,
    input_split_sizes: list[int] | None,
    group: dist.ProcessGroup,
    tag: str = "",
) -> torch.Tensor:
    """``torch.distributed._functional_collectives.all_to_all_single_autograd`` (same
    arguments, same result bit for bit) that hands over to the partner half of a relayed
    pair between posting and waiting, forward and backward."""
    if (output_split_sizes is None) != (input_split_sizes is None):
        raise ValueError("give both output_split_sizes and input_split_sizes, or neither (equal splits)")
    if output_split_sizes is None or input_split_sizes is None:
        size = dist.get_world_size(group)
        output_split_sizes = input_split_sizes = [x.shape[0] // size] * size
    if torch.compiler.is_compiling():
        return _traced_exchange(x, list(output_split_sizes), list(input_split_sizes), group, tag)
    return _RelayedAllToAllSingle.apply(x, list(output_split_sizes), list(input_split_sizes), group)


class Link:
    """The exchanges of one cut exchange share a link: under the emulated network each flies once
    the one posted before it on the link arrived (forward: its dispatch chunks, then its combine
    chunks; backward: their reverse exchanges, in the order autograd posts them)."""

    def __init__(self) -> None:
        self.ready_at: float | None = None

    def post(self, x: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int], group: Any
             ) -> tuple[torch.Tensor, float | None]:
        """:func:`_post` on this link."""
        posted, self.ready_at = _post(x, output_split_sizes, input_split_sizes, group, not_before=self.ready_at)
        return posted, self.ready_at


class PostedExchange:
    """A :func:`post_relayed_all_to_all_single` in flight. :meth:`wait` hands over to the partner
    half, waits, and returns the result, connected to the graph. Backward: the wait's node posts
    the reverse exchange, and the post's node, which autograd reaches later, waits for it, so a cut
    exchange's reverse chunks fly while the chunks' other backward work runs."""

    def __init__(self, x: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int], group: Any,
                 link: Link) -> None:
        self.splits, self.group, self.link = (output_split_sizes, input_split_sizes), group, link
        self.ready_at: float | None = None  # set as it is posted
        self.reverse: tuple[torch.Tensor, float | None] | None = None  # set by the wait's backward
        self.posted = _PostExchange.apply(x, self)

    def wait(self) -> torch.Tensor:
        # the graph's nodes hold this object until their backward: it lets go of the buffer here
        posted, self.posted = self.posted, None
        return _WaitPosted.apply(posted, self)

    def post_reverse(self, grad: torch.Tensor) -> None:
        output_split_sizes, input_split_sizes = self.splits
        self.reverse = self.link.post(grad.contiguous(), input_split_sizes, output_split_sizes, self.group)

    def wait_reverse(self) -> torch.Tensor:
        if self.reverse is None:
            raise RuntimeError("a posted exchange's backward ran before its wait's backward posted the reverse exchange")
        (posted, ready_at), self.reverse = self.reverse, None
        return _wait(posted, ready_at, backward=True)


class _PostExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, exchange: PostedExchange) -> torch.Tensor:  # type: ignore[override]
        ctx.exchange = exchange
        output_split_sizes, input_split_sizes = exchange.splits
        posted, exchange.ready_at = exchange.link.post(x, output_split_sizes, input_split_sizes, exchange.group)
        return posted

    @staticmethod
    def backward(ctx, _: torch.Tensor):  # type: ignore[override]
        return ctx.exchange.wait_reverse(), None


class _WaitPosted(torch.autograd.Function):
    @staticmethod
    def forward(ctx, posted: torch.Tensor, exchange: PostedExchange) -> torch.Tensor:  # type: ignore[override]
        ctx.exchange = exchange
        return _wait(posted, exchange.ready_at, backward=False).view_as(posted)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        ctx.exchange.post_reverse(grad)
        return grad, None


def post_relayed_all_to_all_single(x: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int],
                                   group: dist.ProcessGroup, link: Link) -> PostedExchange:
    """:func:`relayed_all_to_all_single` posted now and waited when the caller chooses
    (:meth:`PostedExchange.wait`, which hands over to the partner half first), so that the caller
    computes while it flies; ``link``: shared by the exchanges of one cut exchange
    (:mod:`titan_dualpipe.titan.expert_chunks`). Eager only."""
    return PostedExchange(x, list(output_split_sizes), list(input_split_sizes), group, link)


# Set by every run of a compiled graph that traced an exchange (dynamo replays the store after
# the graph); read outside graphs by warn_once_if_exchange_traced.
_exchange_traced = False
_told_traced = False


def _traced_exchange(x: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int], group,
                     tag: str) -> torch.Tensor:
    """The exchange inside a graph torch.compile is tracing (a compiled module that calls it,
    such as torchtitan 0.3.0's MoE blocks): torch's traceable exchange, the same result, without
    a hand-over (a compiled graph runs to its end)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    global _exchange_traced
    _exchange_traced = True
    return all_to_all_single_autograd(x, output_split_sizes, input_split_sizes, group, tag)


def warn_once_if_exchange_traced() -> bool:
    """After a relayed pair: say once per process when an exchange ran inside a compiled graph,
    where the partner half cannot run while it is in flight. True when it said so now."""
    global _told_traced
    if not _exchange_traced or _told_traced:
        return False
    _told_traced = True
    logger.warning("an expert-parallel all-to-all runs inside a torch.compile'd graph: a relayed pair cannot "
                   "switch halves inside a graph, so pairs holding it run their halves one after the other; "
                   "to overlap it, compile the parts around the exchange and not the module that calls it (as "
                   "torchtitan 0.2.2 leaves an MoE block's experts uncompiled)")
    return True
