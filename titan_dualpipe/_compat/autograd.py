"""Autograd and thread state behind torch's private names: a thread's private state (for the
relay's helper thread), whether a backward runs now, a context no TorchFunctionMode sees, which
activation-checkpoint regions run (observed on torch's checkpoint classes), and a module's forward
replaced for one call. Read against torch 2.11.0, 2.13.0, 2.14.1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Callable, Iterator

import torch
from torch.utils import checkpoint as _checkpoint_module


@contextlib.contextmanager
def module_forward_replaced(module: torch.nn.Module, fn: Callable[..., Any]) -> Iterator[None]:
    """Within the block, ``module(...)`` runs ``fn`` in place of ``module.forward``
    (module hooks, e.g. FSDP's unshard, still run around it)."""
    previous = module.__dict__.get("forward")  # an instance-level forward set by someone else
    module.forward = fn  # type: ignore[method-assign]
    try:
        yield
    finally:
        if previous is None:
            del module.forward
        else:
            module.forward = previous


_SAC_FORWARD_MODE = _checkpoint_module._CachingTorchDispatchMode  # SAC's forward-side dispatch mode
_CHECKPOINT_HOOKS = _checkpoint_module._checkpoint_hook  # every non-reentrant checkpoint region's hooks
# (class, method entered by every region of that kind, kind)
_OBSERVED = ((_SAC_FORWARD_MODE, "__enter__", "selective"), (_CHECKPOINT_HOOKS, "__enter__", "checkpoint"))
_regions_seen = threading.local()
_observers_lock = threading.Lock()
_observers: list[int] = [0]  # open checkpoint_regions_seen blocks, all threads
_OWN = "titan_dualpipe_own_"


def _recording(kind: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def record_then_call(*args: Any, **kwargs: Any) -> Any:
        seen = getattr(_regions_seen, "kinds", None)
        if seen is not None:
            seen.add(kind)
        return original(*args, **kwargs)

    return record_then_call


def _install_observers(install: bool) -> None:
    for cls, name, kind in _OBSERVED:
        if install:
            own = cls.__dict__.get(name)
            setattr(cls, _OWN + name, own)
            setattr(cls, name, _recording(kind, getattr(cls, name)))
        else:
            own = cls.__dict__[_OWN + name]
            delattr(cls, _OWN + name)
            if own is None:
                delattr(cls, name)
            else:
                setattr(cls, name, own)


@contextlib.contextmanager
def checkpoint_regions_seen() -> Iterator[set[str]]:
    """Within the block, collect which kinds of non-reentrant activation-checkpoint regions run
    on this thread: ``"checkpoint"`` for any non-reentrant one (``torch.utils.checkpoint.checkpoint(...,
    use_reentrant=False)``, torch's ``checkpoint_wrapper``), ``"selective"`` for selective ones
    (``context_fn=create_selective_checkpoint_contexts(...)``), whose saved values serve one
    backward only. Seen when a region enters its saved-tensor hooks and SAC dispatch mode; torch's
    classes get their own methods back when the last open block ends."""
    with _observers_lock:
        if _observers[0] == 0:
            _install_observers(True)
        _observers[0] += 1
    outer = getattr(_regions_seen, "kinds", None)
    kinds: set[str] = set()
    _regions_seen.kinds = kinds
    try:
        yield kinds
    finally:
        _regions_seen.kinds = outer
        if outer is not None:
            outer |= kinds
        with _observers_lock:
            _observers[0] -= 1
            if _observers[0] == 0:
                _install_observers(False)


# -- Thread-local state behind private names ------------------------------------------------------
# torch hands a thread's state to autograd's worker threads in C++ (``at::ThreadLocalState``), which
# Python cannot reach; the relay's helper thread takes the caller's state part by part, these parts
# through the private names below (the public ones, grad mode and autocast, in the relay).


@dataclasses.dataclass(frozen=True)
class PrivateThreadState:
    """A thread's state that torch exposes through private names only (see :func:`private_thread_state`)."""

    saved_tensors_hooks: tuple[Callable[..., Any], Callable[..., Any]] | None  # the innermost pair, the one applied
    saved_tensors_hooks_disabled: str | None  # ``disable_saved_tensors_hooks``'s message
    function_modes: tuple[Any, ...]  # TorchFunctionModes, innermost last
    dispatch_modes: tuple[Any, ...]  # TorchDispatchModes, innermost last
    torch_function_disabled: str | None  # "all" (``DisableTorchFunction``), "subclasses" (``...Subclass``)
    dispatch_keys: tuple[Any, Any]  # the dispatcher's local include and exclude sets
    autograd_multithreading: bool  # ``torch.autograd.set_multithreading_enabled``
    view_replay: bool  # ``torch.autograd._force_original_view_tracking``
    functorch_transform: bool  # inside ``torch.func`` transforms, whose interpreter stack stays on the thread


def private_thread_state() -> PrivateThreadState:
    """This thread's :class:`PrivateThreadState`."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    disabled = ("all" if torch._C._is_torch_function_all_disabled()
                else None if torch._C._is_torch_function_enabled() else "subclasses")
    return PrivateThreadState(
        saved_tensors_hooks=torch._C._autograd._top_saved_tensors_default_hooks(True),
        saved_tensors_hooks_disabled=torch._C._autograd._saved_tensors_hooks_get_disabled_error_message(),
        function_modes=tuple(torch.overrides._get_current_function_mode_stack()),
        dispatch_modes=tuple(_get_current_dispatch_mode_stack()),
        torch_function_disabled=disabled,
        dispatch_keys=(torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set()),
        autograd_multithreading=torch._C._is_multithreading_enabled(),
        view_replay=torch._C._is_view_replay_enabled(),
        functorch_transform=torch._C._functorch.peek_interpreter_stack() is not None,
    )


@contextlib.contextmanager
def private_thread_state_entered(state: PrivateThreadState) -> Iterator[None]:
    """``state`` on this thread within the block (a thread with none of its own: no hooks, no modes);
    the thread's own state after it. Enter it after the public parts (autocast, inference mode): the
    dispatcher's key sets are forced last, to exactly the captured ones. The modes are pushed after
    the flags and hooks are set, and popped before those are reset: a TorchFunctionMode would see
    torch's setters (``torch._C._set_multithreading_enabled``...) as calls of its own."""
    with contextlib.ExitStack() as stack:
        if not state.autograd_multithreading:
            stack.enter_context(torch.autograd.set_multithreading_enabled(False))
        if state.view_replay:
            stack.enter_context(torch.autograd._force_original_view_tracking(True))
        if state.saved_tensors_hooks is not None:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*state.saved_tensors_hooks))
        if state.saved_tensors_hooks_disabled is not None:
            stack.enter_context(torch.autograd.graph.disable_saved_tensors_hooks(state.saved_tensors_hooks_disabled))
        for mode in state.dispatch_modes:  # the stack as it is, without running the modes' __enter__
            torch._C._push_on_torch_dispatch_stack(mode)
            stack.callback(torch._C._pop_torch_dispatch_stack, None)  # the innermost mode
        for mode in state.function_modes:
            torch.overrides._push_mode(mode)
            stack.callback(torch.overrides._pop_mode)
        if state.torch_function_disabled == "all":
            stack.enter_context(torch._C.DisableTorchFunction())
        elif state.torch_function_disabled == "subclasses":
            stack.enter_context(torch._C.DisableTorchFunctionSubclass())
        stack.enter_context(torch._C._ForceDispatchKeyGuard(*state.dispatch_keys))
        yield


def inside_backward() -> bool:
    """Whether this thread runs an autograd backward now (a node's backward, or a checkpointed
    region's recomputation inside one), rather than a forward."""
    return torch._C._current_graph_task_id() != -1


def torch_function_bypassed() -> Any:
    """A context within which no TorchFunctionMode (nor tensor subclass) sees tensor calls: for
    bookkeeping that must stay out of what a user's mode observes."""
    return torch._C.DisableTorchFunction()


__all__ = [
    "PrivateThreadState",
    "checkpoint_regions_seen",
    "inside_backward",
    "module_forward_replaced",
    "private_thread_state",
    "private_thread_state_entered",
    "torch_function_bypassed",
]
