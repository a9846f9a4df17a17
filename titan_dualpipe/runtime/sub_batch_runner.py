"""Two-batch overlap: which stages split their lone microbatches, and the runner interface.

A forward with no partner runs its microbatch as two sub-batches, relayed like a pair
(:mod:`titan_dualpipe.orders.lone_actions` says which microbatches;
:mod:`titan_dualpipe.overlap.sub_batches` runs them; the schedules the package exports carry that
runner as ``sub_batch_runner``, so the dependencies run one way: orders -> runtime -> overlap). The
schedule option ``two_batch_overlap`` is ``False`` (the default: sub-batches pay each op's fixed costs
twice and a second latency per exchange, which outweighed what they hide on the CPU benchmarks,
benchmarks/2026-11-26-cpu-xeon-2core.md#two-batch-overlap), ``True`` (the stages whose module
posts expert-parallel exchanges, as a rule registered with :func:`register_exchange_rule` says),
``"all"`` (every stage) or ``"measured"`` (those of ``True`` where the run's own times say it
pays, :mod:`.two_batch_choice`); all need ``overlap=True``. A microbatch of batch size 1 runs whole.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch

from .._compat.pipelining import _Action

ExchangeRule = Callable[[torch.nn.Module], bool]
_exchange_rules: list[ExchangeRule] = []


def register_exchange_rule(rule: ExchangeRule) -> None:
    """Add a rule: ``rule(stage_module)`` is True when the module posts expert-parallel exchanges."""
    if rule not in _exchange_rules:
        _exchange_rules.append(rule)


def has_exchanges(module: torch.nn.Module) -> bool:
    return any(rule(module) for rule in _exchange_rules)


TWO_BATCH_OPTIONS = (False, True, "all", "measured")


def two_batch_stages(option: bool | str, overlap: bool, modules: dict[int, torch.nn.Module]) -> set[int]:
    """The stages (of ``{stage index: module}``) whose lone microbatches run as sub-batches (under
    "measured": those it measures, :mod:`.two_batch_choice`)."""
    if option not in TWO_BATCH_OPTIONS or not isinstance(option, (bool, str)):
        raise ValueError(f"two_batch_overlap must be False, True (stages with expert-parallel exchanges), "
                         f"'all' (every stage) or 'measured' (those of True where it pays), got {option!r}")
    if option is False:
        return set()
    if not overlap:
        raise ValueError(f"two_batch_overlap={option!r} needs overlap=True: its sub-batches run as a relay; "
                         "pass overlap=True, or two_batch_overlap=False")
    return {s for s, module in modules.items() if option == "all" or has_exchanges(module)}


class SubBatchRunner(Protocol):
    """``executor`` is the :class:`~titan_dualpipe.runtime.executor.StepExecutor` that calls the
    runner; typed ``Any`` so that this module imports neither the executor nor the schedules that
    read its runner (not even for annotations), as ``tests/test_docs.py`` checks."""

    def forward(self, executor: Any, action: _Action) -> None:
        """Run a lone F action on two sub-batches of its microbatch (or whole, when it cannot split)."""

    def backward(self, executor: Any, action: _Action, run: Callable[[], None]) -> None:
        """Run ``run`` (the B, I or W action of a microbatch whose forward ran as sub-batches) with its
        backward on the two sub-batches."""
