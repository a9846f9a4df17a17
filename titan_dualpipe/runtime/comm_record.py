"""Record the communication a process really posts, as a trace for :mod:`..orders.nccl_model`.

gloo buffers sends, so an order can complete on the CPU and still hang under NCCL. Inside
``with CommRecorder() as rec:`` every ``torch.distributed`` point-to-point op, batch and
collective, and every functional collective, this process posts (torch's pipelining, FSDP2, our
twins and losses, torchtitan's expert parallelism, DTensor), and every wait, is recorded in posting
order with the communicator NCCL would run it on. Gather the ranks' ``rec.events`` into
``{rank: events}`` and call :func:`~titan_dualpipe.orders.nccl_model.check_completes`: an order
that would hang under NCCL then fails on a CPU machine. For tests and ``titan-dualpipe check``
(docs/numerics.md#nccls-semantics-on-the-cpu).
"""

from __future__ import annotations

import inspect
import sys
import threading
from typing import Any, Callable, Hashable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.utils._python_dispatch import TorchDispatchMode

from .._compat.pipelining import _Action
from ..orders.nccl_model import RECV, SEND, Collective, Event, P2P, Post, Wait, group_comm, pair_comm

# FSDP2 gathers and reduces with all_gather_single / reduce_scatter_single from torch 2.13 on
_COLLECTIVES = tuple(name for name in ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
                                       "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single",
                                       "all_to_all_single", "barrier", "reduce_scatter", "all_to_all")
                     if hasattr(c10d, name))
_NAMESPACES = (dist, c10d)
_FUNCTIONAL = torch.ops._c10d_functional
# functional collectives and p2p ops; each takes its group (name) as its last positional argument
_FUNCTIONAL_OPS = tuple(name for name in (
    "all_reduce", "all_reduce_", "all_reduce_coalesced", "all_reduce_coalesced_", "all_gather_into_tensor",
    "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor",
    "reduce_scatter_tensor_out", "reduce_scatter_tensor_coalesced", "all_to_all_single", "broadcast", "broadcast_",
    "isend", "irecv", "batch_p2p_ops") if hasattr(_FUNCTIONAL, name))


def _signature(tensor: torch.Tensor | None) -> str:
    """What NCCL matches a message by: element count and type (not shape)."""
    return "" if tensor is None else f"{tensor.numel()} x {str(tensor.dtype).removeprefix('torch.')}"


def _group_name(group: Any) -> str:
    return (group if group is not None else c10d._get_default_group()).group_name


def _members(group: Any) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group if group is not None else c10d._get_default_group()))


def _resolve(group: Any) -> dist.ProcessGroup:
    """A functional op's group argument (a group name, or the group itself) as the group."""
    return group if isinstance(group, dist.ProcessGroup) else c10d._resolve_process_group(group)


def _storage_key(t: torch.Tensor) -> int:
    """What a functional collective's result is waited by (``wait_tensor`` finds its work by storage)."""
    return t.untyped_storage()._cdata


def _functional_ops(name: str, args: tuple, group: dist.ProcessGroup) -> tuple[Hashable, tuple]:
    """The communicator and the model's ops of one functional op call."""
    if name in ("isend", "irecv"):  # global peer ranks (torch's funcol isend/irecv pass them so)
        peer = args[1]
        op = P2P(SEND if name == "isend" else RECV, peer, _signature(args[0]))
        return pair_comm(group.group_name, dist.get_rank(), peer), (op,)
    if name == "batch_p2p_ops":
        kinds, peers, tensors = args[0], args[1], args[3]
        ops = tuple(P2P(SEND if k == "isend" else RECV, p, _signature(t)) for k, p, t in zip(kinds, peers, tensors))
        return group_comm(group.group_name), ops
    tensor = next(iter(_tensors_in(args[:1])), None)
    return group_comm(group.group_name), (Collective(name, _members(group), _signature(tensor)),)


def _tensors_in(values: Any) -> list[torch.Tensor]:
    """Tensors among call arguments (lists of tensors included)."""
    found: list[torch.Tensor] = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


def _action_label() -> str:
    """The schedule action being run (a local ``action`` of a calling frame), for messages."""
    frame = sys._getframe(2)
    for _ in range(80):  # a module's exchange sits deep below the executor's action
        if frame is None:
            break
        action = frame.f_locals.get("action")
        if isinstance(action, _Action):
            return str(action)
        frame = frame.f_back
    return ""


def nccl_eager_init(group: Any) -> bool:
    """Whether NCCL created ``group``'s communicator eagerly: a device is bound to the group
    (``init_process_group(device_id=...)`` binds it, and every group made after it inherits it,
    its communicator created at once). Then NCCL runs the group's lone p2p ops on that
    communicator, in issue order with all its other ops, not on two-rank communicators."""
    pg = group if group is not None else dist.group.WORLD
    return getattr(pg, "bound_device_id", None) is not None and "nccl" in str(dist.get_backend(pg))


class WrongDevice(AssertionError):
    """A tensor handed to a collective or p2p op is not on the stages' device."""


class _RecordedPacket:
    """A functional op's ``torch.ops._c10d_functional.<op>`` entry point that records each call;
    its attributes (``.default`` and the other overloads) stay torch's own."""

    def __init__(self, name: str, packet: Any, record: Callable[[str, Callable, tuple, dict], Any]) -> None:
        self._name, self._packet, self._record = name, packet, record

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._record(self._name, self._packet, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._packet, name)


class _FunctionalMode(TorchDispatchMode):
    """Sees the functional ops that torch calls from C++ (autograd collectives, ``.default``
    overloads) on the thread that entered the recorder and the autograd threads it starts."""

    def __init__(self, record: Callable[[str, Callable, tuple, dict], Any]) -> None:
        super().__init__()
        self._record = record

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """True: torch.compile compiles under the recorder (with False, dynamo skips every frame
        while the mode is active, so compiled blocks would run eagerly); the mode does not see
        the ops inside a compiled graph."""
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func.overloadpacket.__name__
        if func.namespace == "_c10d_functional" and (name in _FUNCTIONAL_OPS or name == "wait_tensor"):
            return self._record(name, func, args, kwargs or {})
        return func(*args, **(kwargs or {}))


class CommRecorder:
    """Context manager; ``events`` holds this process's posts and waits, every thread's in one
    sequence (the relay runs a pair's backward half on a helper thread).

    While active it patches the ``torch.distributed`` functions and the
    ``torch.ops._c10d_functional`` entry points process-wide: use it around a whole ``step()``,
    never beside another recorder. Functional collectives that torch calls from C++ (the autograd
    variants such as ``all_to_all_single_autograd``, an op's ``.default`` overload) are seen
    through a dispatch mode, on the entering thread and the autograd threads it starts only; ops
    inside a compiled graph are not seen (the mode lets torch.compile build graphs). Lone p2p ops
    are recorded on lazy init's two-rank communicators; ``eager_groups`` names the groups whose
    NCCL communicator was made eagerly (:func:`nccl_eager_init`; pass it to
    :func:`~titan_dualpipe.orders.nccl_model.check_completes_eager`). With ``device=``, a tensor
    handed to an op off that device raises :class:`WrongDevice` before it communicates; under
    ``with torch.device("meta"):`` a CPU machine so catches what would be a CPU tensor on a GPU."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else None
        self.events: list[Event] = []
        self.eager_groups: set[str] = set()  # names of the groups seen whose communicator NCCL made eagerly
        self._lock = threading.RLock()
        self._local = threading.local()
        self._works: dict[int, tuple[int, Any]] = {}  # id(Work) -> (work id, the Work, kept alive)
        self._results: dict[int, int] = {}  # storage of a functional op's result -> its work id
        self._mode: _FunctionalMode | None = None
        self._saved: list[tuple[Any, str, Any]] = []

    # -- recording ---------------------------------------------------------------------------
    def _post(self, comm: Any, ops: tuple, works: Any, members: tuple[int, ...] = ()) -> int:
        with self._lock:
            work_id = len(self.events)
            self.events.append(Post(work_id, comm, ops, _action_label(), members))
            items = works if isinstance(works, (list, tuple)) else [works]
            for work in items:
                if work is not None:
                    self._works[id(work)] = (work_id, work)
            if works is None:  # a blocking call: it has completed when it returns
                self.events.append(Wait(work_id))
            return work_id

    def _seen(self, group: Any) -> None:
        if nccl_eager_init(group):
            self.eager_groups.add(_group_name(group))

    def _waited(self, work: Any) -> None:
        with self._lock:
            entry = self._works.get(id(work))
            if entry is not None:
                self.events.append(Wait(entry[0]))

    def _functional(self, name: str, call: Callable, args: tuple, kwargs: dict) -> Any:
        """Run one functional op through ``call`` and record it, once however it was reached
        (the entry point, then the dispatch mode below it on this thread)."""
        if name == "wait_tensor":  # a result's first wait is its Wait, whichever path reached it
            result = call(*args, **kwargs)
            self._waited_result(args[0] if args else kwargs["tensor"])
            return result
        if getattr(self._local, "functional", False):
            return call(*args, **kwargs)
        tensors = _tensors_in((*args, *kwargs.values()))
        self._check_device(name, tensors)
        self._local.functional = True
        try:
            result = call(*args, **kwargs)
        finally:
            self._local.functional = False
        if not (tensors and all(t.is_meta for t in tensors)):  # on meta tensors nothing is exchanged
            self._posted_functional(name, args, kwargs, result)
        return result

    def _posted_functional(self, name: str, args: tuple, kwargs: dict, result: Any) -> None:
        group = _resolve(kwargs["group_name"] if "group_name" in kwargs else args[-1])
        comm, ops = _functional_ops(name, args, group)
        self._seen(group)
        members = _members(group) if comm == group_comm(group.group_name) else ()
        with self._lock:
            work_id = self._post(comm, ops, [], members)
            for t in result if isinstance(result, (list, tuple)) else [result]:
                self._results[_storage_key(t)] = work_id

    def _waited_result(self, tensor: torch.Tensor) -> None:
        tensor = getattr(tensor, "elem", tensor)  # funcol's AsyncCollectiveTensor holds the result
        with self._lock:
            work_id = self._results.pop(_storage_key(tensor), None)
            if work_id is not None:
                self.events.append(Wait(work_id))

    def _check_device(self, call: str, tensors: list) -> None:
        if self.device is None:
            return
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device != self.device:
                where = _action_label()
                raise WrongDevice(f"{call} got a tensor of shape {tuple(t.shape)} on {t.device}; the stages are on "
                                  f"{self.device}{f' (during {where})' if where else ''}")

    @property
    def _inside_batch(self) -> bool:
        return getattr(self._local, "batch", False)

    # -- patched functions ----------------------------------------------------------------------
    def _p2p(self, kind: str, original: Callable, blocking: bool) -> Callable:
        signature = inspect.signature(original)

        def call(*args: Any, **kwargs: Any) -> Any:
            if self._inside_batch:
                return original(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            self._check_device(original.__name__, [a["tensor"]])
            result = original(*args, **kwargs)
            group = a.get("group")
            peer_arg = a.get("dst" if kind == SEND else "src")
            group_peer = a.get("group_dst" if kind == SEND else "group_src")
            peer = peer_arg if peer_arg is not None else dist.get_global_rank(
                group or c10d._get_default_group(), group_peer)
            me = dist.get_rank()
            op = P2P(kind, peer, _signature(a["tensor"]))
            self._seen(group)
            self._post(pair_comm(_group_name(group), me, peer), (op,), None if blocking else result)
            return result

        return call

    def _batch(self, original: Callable) -> Callable:
        def batch_isend_irecv(p2p_op_list: list) -> Any:
            self._check_device("batch_isend_irecv", [p.tensor for p in p2p_op_list])
            self._local.batch = True
            try:
                works = original(p2p_op_list)
            finally:
                self._local.batch = False
            if p2p_op_list:
                ops = tuple(P2P(SEND if p.op in (dist.isend, c10d.isend, self._originals["isend"]) else RECV,
                                p.peer, _signature(p.tensor)) for p in p2p_op_list)
                group = p2p_op_list[0].group
                self._seen(group)
                self._post(group_comm(_group_name(group)), ops, list(works), _members(group))
            return works

        return batch_isend_irecv

    def _collective(self, name: str, original: Callable) -> Callable:
        signature = inspect.signature(original)

        def call(*args: Any, **kwargs: Any) -> Any:
            if self._inside_batch:
                return original(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            self._check_device(name, _tensors_in(bound.arguments.values()))
            result = original(*args, **kwargs)
            group = bound.arguments.get("group")
            tensor = next((v for v in bound.arguments.values() if isinstance(v, torch.Tensor)), None)
            op = Collective(name, _members(group), _signature(tensor))
            self._seen(group)
            async_op = bound.arguments.get("async_op", False)
            self._post(group_comm(_group_name(group)), (op,), result if async_op else None, _members(group))
            return result

        return call

    def _wait(self, original: Callable) -> Callable:
        def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(work, *args, **kwargs)
            self._waited(work)
            return result

        return wait

    # -- context ---------------------------------------------------------------------------------
    def __enter__(self) -> "CommRecorder":
        self._originals = {name: getattr(c10d, name) for name in ("isend", "irecv", "send", "recv", "batch_isend_irecv",
                                                                   *_COLLECTIVES)}
        replacements = {
            "isend": self._p2p(SEND, self._originals["isend"], blocking=False),
            "irecv": self._p2p(RECV, self._originals["irecv"], blocking=False),
            "send": self._p2p(SEND, self._originals["send"], blocking=True),
            "recv": self._p2p(RECV, self._originals["recv"], blocking=True),
            "batch_isend_irecv": self._batch(self._originals["batch_isend_irecv"]),
            **{name: self._collective(name, self._originals[name]) for name in _COLLECTIVES},
        }
        for namespace in _NAMESPACES:
            for name, fn in replacements.items():
                self._saved.append((namespace, name, getattr(namespace, name)))
                setattr(namespace, name, fn)
        self._saved.append((dist.Work, "wait", dist.Work.wait))
        dist.Work.wait = self._wait(dist.Work.wait)
        for name in (*_FUNCTIONAL_OPS, "wait_tensor"):
            packet = getattr(_FUNCTIONAL, name)
            self._saved.append((_FUNCTIONAL, name, packet))
            setattr(_FUNCTIONAL, name, _RecordedPacket(name, packet, self._functional))
        self._mode = _FunctionalMode(self._functional)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        for owner, name, value in reversed(self._saved):
            setattr(owner, name, value)
        self._saved.clear()
        self._works.clear()
        self._results.clear()
