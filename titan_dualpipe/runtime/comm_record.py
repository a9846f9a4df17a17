"""Record the communication a process really posts, as a trace for :mod:`..orders.nccl_model`.

Inside ``with CommRecorder() as rec:`` every ``torch.distributed`` point-to-point op, batch
and collective this process posts (torch's pipelining, FSDP2, our twins and losses alike) is
recorded in posting order with the communicator NCCL would run it on, and so is every
``Work.wait()``. Gather the ranks' ``rec.events`` into ``{rank: events}`` and call
:func:`~titan_dualpipe.orders.nccl_model.check_completes`: an order that gloo completes (it
buffers sends) but that would hang under NCCL then fails on a CPU machine.

With ``device=``, every tensor handed to a collective or p2p op must live on that device (the
stages' device: NCCL rejects CPU tensors); a call that breaks the rule raises
:class:`WrongDevice` before it communicates. Under ``with torch.device("meta"):`` a tensor made
without ``device=`` lands on ``meta``, so a CPU machine catches what would be a CPU tensor on
a GPU machine.

For tests and ``titan-dualpipe check``; it patches module attributes while active, so use it
around a whole ``step()``, not concurrently with another recorder.
"""

from __future__ import annotations

import inspect
import sys
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from .._compat import _Action
from ..orders.nccl_model import RECV, SEND, Collective, Event, P2P, Post, Wait, group_comm, pair_comm

# FSDP2 gathers and reduces with all_gather_single / reduce_scatter_single from torch 2.13 on
_COLLECTIVES = tuple(name for name in ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
                                       "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single",
                                       "all_to_all_single", "barrier", "reduce_scatter", "all_to_all")
                     if hasattr(c10d, name))
_NAMESPACES = (dist, c10d)


def _signature(tensor: torch.Tensor | None) -> str:
    """What NCCL matches a message by: element count and type (not shape)."""
    return "" if tensor is None else f"{tensor.numel()} x {str(tensor.dtype).removeprefix('torch.')}"


def _group_name(group: Any) -> str:
    return (group if group is not None else c10d._get_default_group()).group_name


def _members(group: Any) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group if group is not None else c10d._get_default_group()))


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
    for _ in range(40):
        if frame is None:
            break
        action = frame.f_locals.get("action")
        if isinstance(action, _Action):
            return str(action)
        frame = frame.f_back
    return ""


class WrongDevice(AssertionError):
    """A tensor handed to a collective or p2p op is not on the stages' device."""


class CommRecorder:
    """Context manager; ``events`` holds this process's posts and waits (see module docstring)."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else None
        self.events: list[Event] = []
        self._lock = threading.RLock()
        self._local = threading.local()
        self._works: dict[int, tuple[int, Any]] = {}  # id(Work) -> (work id, the Work, kept alive)
        self._saved: list[tuple[Any, str, Any]] = []

    # -- recording ---------------------------------------------------------------------------
    def _post(self, comm: Any, ops: tuple, works: Any) -> None:
        with self._lock:
            work_id = len(self.events)
            self.events.append(Post(work_id, comm, ops, _action_label()))
            items = works if isinstance(works, (list, tuple)) else [works]
            for work in items:
                if work is not None:
                    self._works[id(work)] = (work_id, work)
            if works is None:  # a blocking call: it has completed when it returns
                self.events.append(Wait(work_id))

    def _waited(self, work: Any) -> None:
        with self._lock:
            entry = self._works.get(id(work))
            if entry is not None:
                self.events.append(Wait(entry[0]))

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
                self._post(group_comm(_group_name(p2p_op_list[0].group)), ops, list(works))
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
            async_op = bound.arguments.get("async_op", False)
            self._post(group_comm(_group_name(group)), (op,), result if async_op else None)
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
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, value in reversed(self._saved):
            setattr(owner, name, value)
        self._saved.clear()
        self._works.clear()
