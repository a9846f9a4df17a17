"""Deferred weight GEMMs: an ``I`` computes input gradients now and queues the weight GEMMs for ``W``.

torch's split backward runs autograd twice through a microbatch's graph (``I`` with
``retain_graph``, then ``W``), so every activation-checkpointed region is recomputed twice and a
selective-AC region cannot be split at all (:mod:`.split_backward`). Deferring the GEMM instead
needs one autograd pass:

- A forward whose backward will be an ``I`` runs inside :meth:`WeightGradQueue.deferring`: each
  installed ``nn.Linear`` (and expert GEMM, :mod:`.deferred_gemms`) builds nodes that take the
  weight out of the autograd graph and hand its gradient to the queue.
- At ``I`` the stage runs its full backward inside :meth:`WeightGradQueue.collecting`: input
  gradients and every other parameter's gradient as usual, each weight GEMM ``dW = dY^T X``
  queued with its two operands.
- At ``W`` the queue computes them and gives the results to autograd (one
  ``torch.autograd.backward`` from the weights): the parameters' own accumulation runs, with their
  tensor hooks (which see the microbatch's whole gradient) and post-accumulate-grad hooks, in the
  parameters' dtype.

Every other forward (a ``B``, a forward outside a step) is plain autograd. As the weight is no
input of the deferred nodes, nothing reaches its accumulation at ``I``: its hooks never see a
missing gradient. Under autocast the nodes cast as autocast does (input and bias through
autograd, the weight once per step), so the GEMMs and the gradients' dtypes are autocast's.

Inside a ``torch.compile``'d region (``weight_gradients="deferred_compiled"``; under
``"deferred"`` a stage holding compiled modules runs its backward whole at ``I``) an
``nn.Linear`` defers through :class:`_CompiledDeferrableLinear`: its backward is traced into the
compiled graph, with the weight GEMM as a custom operator (``titan_dualpipe::linear_weight_gemm``)
that the graph keeps opaque. The operator decides when it runs: inside an ``I`` it queues the
GEMM (on copies of its operands, since the compiled graph may reuse their buffers after the
call) and returns zeros, which autograd adds to the gradient; elsewhere it computes the GEMM.
So one compiled graph serves both, without recompiling. Gradient hooks on those weights would
see the zeros at ``I``: the schedule refuses hooks there (:func:`compiled_hooks_problem`).

Not deferred: DTensor weights inside a compiled region (the operator has no sharding rule),
modules whose forward is wrapped on the instance inside a compiled region (their GEMMs run in
the compiled backward at ``I``), subclasses with a forward of their own, weights computed from
others (parametrizations), frozen weights, and modules left out by name.
"""

from __future__ import annotations

import fnmatch
import itertools
import types
import weakref
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .weight_queue import WeightGradQueue, autocast_dtype, defer_or_accumulate

WEIGHT_GRADIENT_MODES = ("deferred", "deferred_compiled", "split", "whole")
DEFERRING_MODES = ("deferred", "deferred_compiled")  # the modes that install deferred GEMMs


def weight_gradients_problem(mode: object, not_deferred: object) -> None:
    """ValueError (before any collective) for a ``weight_gradients`` / ``not_deferred`` option that cannot work."""
    from .errors import PipelineConfigError

    if mode not in WEIGHT_GRADIENT_MODES:
        raise PipelineConfigError(f"weight_gradients={mode!r}: use one of {', '.join(map(repr, WEIGHT_GRADIENT_MODES))}")
    if isinstance(not_deferred, str) or not all(isinstance(name, str) for name in not_deferred):  # type: ignore[union-attr]
        raise PipelineConfigError(f"not_deferred={not_deferred!r}: pass a list of module names or fnmatch patterns, "
                                  f"e.g. ['output', 'layers.*.attention.wq']")


class _LinearCall:
    """One deferrable ``F.linear`` call's weight, out of the graph (not an input of its nodes), and
    ``dY``, handed from its GEMM's backward to its operands' node."""

    __slots__ = ("weight", "grad_2d")

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.grad_2d: torch.Tensor | None = None


class _LinearOperands(torch.autograd.Function):
    """The input of one deferrable ``F.linear`` call, passed on unchanged and saved for its
    weight GEMM, which this node queues for ``W`` (or accumulates at once, outside an ``I``).

    It runs before the GEMM and saves its operand then, while the GEMM's node saves nothing: in
    a checkpointed region's recomputation, torch stops at the last saved tensor (early stop), so
    a region ending in a linear layer skips that layer's forward GEMM, as under plain autograd.
    One node that computes and saves would save after its GEMM, which then always reruns (a
    third of a Transformer block's recomputed GEMM work when the block ends in its MLP).
    ``anchor`` keeps the node in the graph when the input needs no gradient.
    """

    @staticmethod
    def forward(ctx, input: torch.Tensor, anchor: torch.Tensor | None, queue: WeightGradQueue,
                call: _LinearCall) -> torch.Tensor:
        ctx.save_for_backward(input)
        # The gradient goes to the parameter itself: a checkpointed region's saved tensors come
        # back from its recomputation as detached aliases.
        ctx.queue, ctx.call = queue, call
        ctx.set_materialize_grads(False)
        return input.view_as(input)

    @staticmethod
    def backward(ctx, grad_input: torch.Tensor | None):
        (input,) = ctx.saved_tensors
        grad_2d, ctx.call.grad_2d = ctx.call.grad_2d, None
        if grad_2d is not None:
            input_2d = input.reshape(-1, input.shape[-1])
            defer_or_accumulate(ctx.queue, ctx.call.weight, lambda: grad_2d.t().mm(input_2d), "linear",
                                (grad_2d, input_2d))
        return grad_input, None, None, None


class _DeferrableLinear(torch.autograd.Function):
    """``F.linear`` whose weight GEMM is left to its input's :class:`_LinearOperands` node:
    this node computes ``dX = dY W`` and the bias gradient and hands ``dY`` on.

    The GEMMs are those autograd runs for ``F.linear`` (``dX = dY W``, ``dW = dY^T X`` on the
    inputs flattened to 2-D), so a gradient computed at once equals autograd's. Nothing is saved
    here (the weight is a parameter, or autocast's cast of one, held as is), so a recomputation
    may stop before the GEMM.
    """

    @staticmethod
    def forward(ctx, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                input_needs_grad: bool, call: _LinearCall) -> torch.Tensor:
        ctx.weight, ctx.input_needs_grad, ctx.call = weight, input_needs_grad, call
        ctx.input_shape = input.shape
        return F.linear(input, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_2d = grad.reshape(-1, grad.shape[-1])
        ctx.call.grad_2d = grad_2d
        grad_input, grad_bias = _input_and_bias_grads(grad_2d, ctx.weight, ctx.input_shape, ctx.input_needs_grad,
                                                      ctx.needs_input_grad[2])
        return grad_input, None, grad_bias, None, None


def deferrable_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      queue: WeightGradQueue) -> torch.Tensor:
    """``F.linear(input, weight, bias)`` whose weight GEMM waits for ``W`` when its backward runs
    inside an ``I`` (``weight``: a parameter that needs a gradient), under autocast as autocast runs it."""
    dtype = autocast_dtype(input)
    if dtype is None:
        return _linear_nodes(input, weight, bias, queue, queue.compute_weight(weight, weight.dtype))
    # cast here as autocast would (its own casts of these operands are then no-ops); no autocast
    # context is entered: its exit could clear autocast's process-wide cast cache
    bias = bias.to(dtype) if bias is not None else None
    return _linear_nodes(input.to(dtype), weight, bias, queue, queue.compute_weight(weight, dtype))


def _linear_nodes(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, queue: WeightGradQueue,
                  compute_weight: torch.Tensor) -> torch.Tensor:
    call = _LinearCall(weight)
    anchor = None if input.requires_grad else queue.anchor(input.device)
    operand = _LinearOperands.apply(input, anchor, queue, call)
    return _DeferrableLinear.apply(operand, compute_weight, bias, input.requires_grad, call)


def _input_and_bias_grads(grad_2d: torch.Tensor, weight: torch.Tensor, input_shape: torch.Size, input_needs_grad: bool,
                          bias_needs_grad: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``F.linear``'s input gradient (``dX = dY W``, the GEMM autograd runs) and bias gradient from
    the output gradient ``dY`` flattened to 2-D; None where not needed."""
    grad_input = grad_2d.mm(weight).view(input_shape) if input_needs_grad else None
    return grad_input, grad_2d.sum(0) if bias_needs_grad else None


def _linear_grads(ctx: Any, grad: torch.Tensor,
                  weight_grad: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> tuple:
    """``F.linear``'s gradients (input, weight, bias, and None for the extra argument) from the
    saved input and weight, with the GEMMs autograd runs (``dX = dY W``; ``dW = dY^T X`` on the
    inputs flattened to 2-D, left to ``weight_grad(dY, X, W)``)."""
    input, weight = ctx.saved_tensors
    grad_2d = grad.reshape(-1, grad.shape[-1])
    grad_input, grad_bias = _input_and_bias_grads(grad_2d, weight, input.shape, ctx.needs_input_grad[0],
                                                  ctx.needs_input_grad[2])
    grad_weight = weight_grad(grad_2d, input.reshape(-1, input.shape[-1]), weight) if ctx.needs_input_grad[1] else None
    return grad_input, grad_weight, grad_bias, None


def _compiled_weight_gemm(queue: WeightGradQueue, parameter: torch.Tensor, grad_2d: torch.Tensor,
                          input_2d: torch.Tensor) -> torch.Tensor | None:
    """``dW = dY^T X`` at once, or None when it is queued for ``W`` (inside an ``I``), on copies of
    the operands (a compiled graph may reuse their buffers once the call returns)."""
    if queue.target is not None:
        grad_2d, input_2d = grad_2d.clone(), input_2d.clone()
        if queue.defer(parameter, lambda: grad_2d.t().mm(input_2d), holds=(grad_2d, input_2d)):
            return None
    return grad_2d.t().mm(input_2d)


_linears_by_key: dict[int, "weakref.ref[nn.Module]"] = {}  # installed nn.Linear modules, for compiled graphs
_linear_keys = itertools.count()


def _linear_of(key: int) -> nn.Module | None:
    ref = _linears_by_key.get(key)
    return ref() if ref is not None else None


# Marked unsafe for CUDA graphs: whether it queues is decided at run time, and a queued GEMM holds
# its operands past the call, neither of which a captured graph can replay.
@torch.library.custom_op("titan_dualpipe::linear_weight_gemm", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _linear_weight_gemm(grad_2d: torch.Tensor, input_2d: torch.Tensor, weight: torch.Tensor, key: int) -> torch.Tensor:
    """``dW = dY^T X`` of installed ``nn.Linear`` ``key`` in a compiled backward; inside an ``I``,
    queued for ``W`` (zeros returned: autograd adds them to the gradient, ``W`` adds the GEMM)."""
    module = _linear_of(key)
    queue = getattr(module, "_weight_grad_queue", None)
    parameter = getattr(module, "weight", None)  # the tensor autograd accumulates into (FSDP2: the gathered one)
    if queue is None or parameter.data_ptr() != weight.data_ptr() or parameter.shape != weight.shape:
        return grad_2d.t().mm(input_2d)
    grad_weight = _compiled_weight_gemm(queue, parameter, grad_2d, input_2d)
    return torch.zeros_like(weight) if grad_weight is None else grad_weight


@_linear_weight_gemm.register_fake
def _(grad_2d: torch.Tensor, input_2d: torch.Tensor, weight: torch.Tensor, key: int) -> torch.Tensor:
    return weight.new_empty(weight.shape)


class _CompiledDeferrableLinear(torch.autograd.Function):
    """``F.linear`` for a compiled region: the input GEMM is traced as usual, the weight GEMM is
    :func:`_linear_weight_gemm`, which decides at run time whether it waits for ``W``."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, key: int) -> torch.Tensor:
        ctx.save_for_backward(input, weight)
        ctx.key = key
        return F.linear(input, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _linear_grads(ctx, grad, lambda grad_2d, input_2d, weight: torch.ops.titan_dualpipe.linear_weight_gemm(
            grad_2d, input_2d, weight, ctx.key))


class _DeferrableLinearForward:
    """The forward of an installed ``nn.Linear`` (mixed in ahead of its class)."""

    _weight_grad_queue: WeightGradQueue
    _deferral_key: int

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        # A weight computed from others (a parametrization) gets its gradient through autograd;
        # an uninstalled module reaches here through a wrapper bound while it was installed.
        if (not torch.is_grad_enabled() or not weight.requires_grad or not weight.is_leaf
                or not isinstance(self, _DeferrableLinearForward)):
            return F.linear(input, self.weight, self.bias)
        if torch.compiler.is_compiling():
            if _is_dtensor(weight):  # no sharding rule for the operator: the GEMM stays in the graph
                return F.linear(input, self.weight, self.bias)
            return _CompiledDeferrableLinear.apply(input, self.weight, self.bias, self._deferral_key)
        if not self._weight_grad_queue.routes_now():  # a forward whose backward computes its weight gradient
            return F.linear(input, self.weight, self.bias)
        return deferrable_linear(input, self.weight, self.bias, self._weight_grad_queue)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


class _DeferringLinearCalls(TorchFunctionMode):
    """Routes the ``F.linear`` calls of one forward whose weight needs a gradient through
    :func:`deferrable_linear`: an installed ``nn.Linear`` whose forward an instance attribute
    replaced (torchtitan 0.3.0's ``Module.parallelize`` wraps it with input and output
    redistribution, around the forward the class had then)."""

    def __init__(self, queue: WeightGradQueue) -> None:
        super().__init__()
        self.queue = queue

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled():
            named = {**dict(zip(("input", "weight", "bias"), args)), **kwargs}
            input, weight, bias = named["input"], named["weight"], named.get("bias")
            if isinstance(weight, torch.Tensor) and weight.requires_grad and weight.is_leaf:
                return deferrable_linear(input, weight, bias, self.queue)
        return func(*args, **kwargs)


class _DeferrableExpertsForward:
    """The forward of an installed expert module (mixed in ahead of its class): its GEMMs with
    weight operands run through :class:`~.deferred_gemms.DeferringExpertGemms`."""

    _weight_grad_queue: WeightGradQueue

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(self, _DeferrableExpertsForward):  # uninstalled, reached through a wrapper bound before
            return type(self).forward(self, *args, **kwargs)
        if not torch.is_grad_enabled() or torch.compiler.is_compiling() or not self._weight_grad_queue.routes_now():
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        from .deferred_gemms import DeferringExpertGemms

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
    from .split_backward import compiled_modules  # split_backward imports this module

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
        if mixin is _DeferrableLinearForward and _linear_of(getattr(child, "_deferral_key", -1)) is not child:
            key = child._deferral_key = next(_linear_keys)  # compiled graphs name the module by it (a copy gets its own)
            _linears_by_key[key] = weakref.ref(child, lambda _, key=key: _linears_by_key.pop(key, None))
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
        from .deferred_gemms import DeferringExpertGemms

        routing = DeferringExpertGemms(self._weight_grad_queue)
    with routing:
        return self._forward_before_deferral(*args, **kwargs)


def uninstall(module: nn.Module) -> None:
    """Give every installed ``nn.Linear`` in ``module`` its own class back."""
    for child in module.modules():
        if isinstance(child, (_DeferrableLinearForward, _DeferrableExpertsForward)):
            child.__class__ = type(child)._original_class
            del child._weight_grad_queue
            if "_deferral_key" in vars(child):
                _linears_by_key.pop(child.__dict__.pop("_deferral_key"), None)
            if "_forward_before_deferral" in vars(child):
                child.forward = child._forward_before_deferral
                del child._forward_before_deferral
