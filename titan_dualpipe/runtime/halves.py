"""Two-batch overlap: which stages split their lone microbatches, and the runner interface.

A forward with no partner runs its microbatch as two halves, relayed like a pair
(:mod:`titan_dualpipe.orders.two_batch` says which microbatches;
:mod:`titan_dualpipe.overlap.halves` runs them and registers itself here, so the dependencies
run one way: orders -> runtime -> overlap).

The schedule option ``two_batch_overlap``:

- ``None`` (default): on for stage modules with expert-parallel exchanges (a rule registered
  with :func:`register_exchange_rule` says so: our MoE module, torchtitan's MoE under expert
  parallelism), when ``overlap`` is on. Elsewhere splitting has nothing to hide and only makes
  the matrix products smaller.
- ``True``: on for every stage (needs ``overlap=True``); ``False``: off.

A microbatch whose batch dimension is 1 cannot be split and runs whole.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

import torch

from .._compat import _Action

if TYPE_CHECKING:
    from .executor import StepExecutor

ExchangeRule = Callable[[torch.nn.Module], bool]
_exchange_rules: list[ExchangeRule] = []


def register_exchange_rule(rule: ExchangeRule) -> None:
    """Add a rule: ``rule(stage_module)`` is True when the module posts expert-parallel exchanges."""
    if rule not in _exchange_rules:
        _exchange_rules.append(rule)


def has_exchanges(module: torch.nn.Module) -> bool:
    return any(rule(module) for rule in _exchange_rules)


def two_batch_stages(option: bool | None, overlap: bool, modules: dict[int, torch.nn.Module]) -> set[int]:
    """The stages (of ``{stage index: module}``) whose lone microbatches run in halves."""
    if option is not None and not isinstance(option, bool):
        raise ValueError(f"two_batch_overlap must be True, False or None (automatic), got {option!r}")
    if option and not overlap:
        raise ValueError("two_batch_overlap=True needs overlap=True: its halves run as a relay; "
                         "pass overlap=True, or two_batch_overlap=False")
    if option is False or not overlap:
        return set()
    return {s for s, module in modules.items() if option or has_exchanges(module)}


class HalvesRunner(Protocol):
    def forward(self, executor: "StepExecutor", action: _Action) -> None:
        """Run a lone F action on two halves of its microbatch (or whole, when it cannot split)."""

    def backward(self, executor: "StepExecutor", action: _Action, run: Callable[[], None]) -> None:
        """Run ``run`` (the B, I or W action of a microbatch whose forward ran in halves) with its
        backward on the two halves."""


_runner: HalvesRunner | None = None


def register_halves_runner(runner: HalvesRunner) -> None:
    global _runner
    _runner = runner


def halves_runner() -> HalvesRunner:
    if _runner is None:
        raise RuntimeError("no two-batch runner registered: import titan_dualpipe (it imports titan_dualpipe.overlap)")
    return _runner
