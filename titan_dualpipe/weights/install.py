"""Installing deferral on a stage's modules: which modules defer, and routing them to a queue.

:func:`install` swaps each deferrable module's class for one whose forward routes its GEMMs
(plain ``nn.Linear``: :mod:`.linear`; registered expert classes: :mod:`.experts`) through the
schedule's queue; :func:`uninstall` gives the classes back. Left out: subclasses with a forward of
their own, frozen or computed weights (they fall back to autograd at run time) and modules named
in ``not_deferred``.
"""

from __future__ import annotations

import fnmatch
import types
from typing import Any, Iterable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .experts import DeferringExpertGemms
from .linear import _DeferrableLinearForward, _DeferringLinearCalls, forget_linear, key_linear
from .plan import compiled_modules
from .queue import WeightGradQueue


class _DeferrableExpertsForward:
    """The forward of an installed expert module (mixed in ahead of its class): its GEMMs with
    weight operands run through :class:`~.experts.DeferringExpertGemms`."""

    _weight_grad_queue: WeightGradQueue

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(self, _DeferrableExpertsForward):  # uninstalled, reached through a wrapper bound before
            return type(self).forward(self, *args, **kwargs)
        if not torch.is_grad_enabled() or torch.compiler.is_compiling() or not self._weight_grad_queue.routes_now():
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        with DeferringExpertGemms(self._weight_grad_queue):
            return super().forward(*args, **kwargs)  # type: ignore[misc]


_expert_classes: list[type] = []


def register_expert_class(cls: type) -> None:
    """Defer the weight GEMMs of ``cls`` modules (mixture-of-experts layers: every GEMM in their
    forward whose second operand needs a gradient is an expert weight GEMM)."""
    if cls not in _expert_classes:
        _expert_classes.append(cls)


_installed_classes: dict[tuple[type, type], type] = {}


def _deferrable_class(cls: type, mixin: type) -> type:
    if (cls, mixin) not in _installed_classes:
        _installed_classes[(cls, mixin)] = type(cls.__name__, (mixin, cls), {"_original_class": cls})
    return _installed_classes[(cls, mixin)]


def _mixin_for(module: nn.Module) -> type | None:
    """How ``module`` defers its weight GEMMs, or None: a plain ``nn.Linear`` (its class keeps
    ``nn.Linear.forward``) or a registered expert class."""
    original = getattr(type(module), "_original_class", type(module))
    if issubclass(original, nn.Linear) and original.forward is nn.Linear.forward:
        return _DeferrableLinearForward
    if any(issubclass(original, cls) for cls in _expert_classes):
        return _DeferrableExpertsForward
    return None


def _excluded(name: str, exclude: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) or name.startswith(pattern + ".") for pattern in exclude)


def deferrable_modules(module: nn.Module, exclude: Iterable[str] = (), compiled: bool = False) -> dict[str, nn.Module]:
    """The modules of ``module`` whose weight GEMMs can wait for ``W``, by qualified name: plain
    ``nn.Linear`` modules and registered expert modules (:func:`register_expert_class`).

    Left out: names matching an ``exclude`` pattern (``fnmatch``, or a module path prefix),
    modules inside a compiled region (``compiled=True``: only its expert modules), and
    ``nn.Linear`` subclasses with a forward of their own."""
    exclude = list(exclude)
    regions = ["" if name == "<stage module>" else name for name in compiled_modules(module)]
    found: dict[str, nn.Module] = {}
    for name, child in module.named_modules():
        mixin = _mixin_for(child)
        if mixin is None or _excluded(name, exclude):
            continue
        in_compiled = any(prefix == "" or name == prefix or name.startswith(prefix + ".") for prefix in regions)
        if in_compiled and (not compiled or mixin is not _DeferrableLinearForward):
            continue
        found[name] = child
    return found


def install(module: nn.Module, queue: WeightGradQueue, exclude: Iterable[str] = (), compiled: bool = False) -> list[str]:
    """Route ``module``'s deferrable modules through ``queue`` (``compiled``: the ``nn.Linear``
    modules inside compiled regions too); their names.

    Installing again (a new schedule over the same modules) points them at the new queue."""
    modules = deferrable_modules(module, exclude, compiled)
    for child in modules.values():
        mixin = _mixin_for(child)
        if not isinstance(child, mixin):
            child.__class__ = _deferrable_class(type(child), mixin)
            if "forward" in vars(child):  # a wrapper around the class's forward: it never reaches the mixin's
                child._forward_before_deferral = child.forward
                child.forward = types.MethodType(_deferring_instance_forward, child)
        child._weight_grad_queue = queue
        if mixin is _DeferrableLinearForward:
            key_linear(child)
    return list(modules)


def compiled_hooks_problem(module: nn.Module, exclude: Iterable[str]) -> str:
    """Under ``weight_gradients="deferred_compiled"``: the ``nn.Linear`` modules inside compiled regions
    whose weight has gradient hooks, which would see the compiled graph's zeros at ``I``."""
    exclude = list(exclude)
    compiled = set(deferrable_modules(module, exclude, compiled=True)) - set(deferrable_modules(module, exclude))
    hooked = [name for name in sorted(compiled) if _has_grad_hooks(module.get_submodule(name).weight)]
    if not hooked:
        return ""
    return (f"weight_gradients='deferred_compiled': the weights of {', '.join(hooked[:3])} inside compiled blocks have "
            "gradient hooks (register_hook / register_post_accumulate_grad_hook), which would run at I on the compiled "
            "graph's zeros; use weight_gradients='deferred' (compiled blocks then run their backward whole at I, hooks "
            "as under autograd), or not_deferred=[...] naming them")


def _has_grad_hooks(param: torch.Tensor) -> bool:
    return bool(getattr(param, "_backward_hooks", None) or getattr(param, "_post_accumulate_grad_hooks", None))


def routed_to(module: nn.Module, names: Iterable[str], queue: WeightGradQueue) -> bool:
    """Whether each of ``module``'s modules ``names`` (as :func:`install` returned them) is
    installed and routes its GEMMs through ``queue``."""
    return all(getattr(module.get_submodule(name), "_weight_grad_queue", None) is queue for name in names)


def _deferring_instance_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """An installed module's instance-level forward: the one it had, its GEMMs routed as the
    mixin's forward routes them (a bound method, so a deep copy calls the copy's forward)."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling() or not self._weight_grad_queue.routes_now():
        return self._forward_before_deferral(*args, **kwargs)
    if isinstance(self, _DeferrableLinearForward):
        routing: TorchFunctionMode = _DeferringLinearCalls(self._weight_grad_queue)
    else:
        routing = DeferringExpertGemms(self._weight_grad_queue)
    with routing:
        return self._forward_before_deferral(*args, **kwargs)


def uninstall(module: nn.Module) -> None:
    """Give every installed ``nn.Linear`` in ``module`` its own class back."""
    for child in module.modules():
        if isinstance(child, (_DeferrableLinearForward, _DeferrableExpertsForward)):
            child.__class__ = type(child)._original_class
            del child._weight_grad_queue
            forget_linear(child)
            if "_forward_before_deferral" in vars(child):
                child.forward = child._forward_before_deferral
                del child._forward_before_deferral
