"""DualPipe's two chains on torch's stages, which assume one: a stage's ``is_first`` / ``is_last``
follow its own chain, and the hand-offs between the two chain ends on one rank are left out
(:func:`set_chain_ends`).
"""

from __future__ import annotations

from typing import Any, Callable

from .._compat.pipelining import _PipelineStageBase


def _chain_first(stage: Any) -> bool:
    return stage._chain_first


def _chain_last(stage: Any) -> bool:
    return stage._chain_last


def _skip_at(end: str, method: Callable[..., Any], doing: str) -> Callable[..., Any]:
    """``method``, ignored on a stage at chain end ``end`` (``"_chain_first"``/``"_chain_last"``)."""

    def hand_off(self: Any, value: Any, mb_index: int) -> None:
        if not getattr(self, end):
            method(self, value, mb_index)

    hand_off.__doc__ = f"torch's {method.__name__}; on a DualPipe chain end, {doing}."
    return hand_off


def _input_grads_of_chain_first(base: type) -> Callable[[Any, int], Any]:
    def get_local_bwd_output(self: Any, mb_index: int) -> Any:
        if self._chain_first:  # the grads of the batch's inputs: nobody on this chain receives them
            return self.bwd_cache.pop(mb_index, ())
        return base.get_local_bwd_output(self, mb_index)

    return get_local_bwd_output


_CHAIN_END_CLASSES: dict[type, type] = {}


def set_chain_ends(stage: _PipelineStageBase, *, first: bool, last: bool) -> None:
    """Make ``stage.is_first`` / ``is_last`` follow its own chain, not ``stage_index``.

    torch assumes one chain ``0..num_stages-1``. DualPipe has two (one per direction), so
    the last stage of direction 0 and the first stage of direction 1 sit in the middle of
    the index range. Every torch stage method keys input and loss handling on these two
    properties, so the stage's class is swapped for a subclass that overrides them.

    Code written for torch's single chain hands data between same-rank stages ``s`` and ``s+1``;
    on DualPipe's rank pp-1 those are the two chain ends (stages pp-1 and pp), which exchange
    nothing: the subclass ignores those hand-offs (``set_local_fwd_input`` on a chain's first
    stage, ``set_local_bwd_input`` on a last one) and gives a first stage's input grads back.
    """
    base = type(stage)
    if base not in _CHAIN_END_CLASSES.values():
        cls = _CHAIN_END_CLASSES.get(base)
        if cls is None:
            attrs = {"__slots__": (), "is_first": property(_chain_first), "is_last": property(_chain_last),
                     "set_local_fwd_input": _skip_at("_chain_first", base.set_local_fwd_input,
                                                     "ignored on a first stage (it reads the batch)"),
                     "set_local_bwd_input": _skip_at("_chain_last", base.set_local_bwd_input,
                                                     "ignored on a last stage (it starts from the loss)"),
                     "get_local_bwd_output": _input_grads_of_chain_first(base)}
            cls = _CHAIN_END_CLASSES[base] = type(f"ChainEnd{base.__name__}", (base,), attrs)
        stage.__class__ = cls
    stage._chain_first = first  # type: ignore[attr-defined]
    stage._chain_last = last  # type: ignore[attr-defined]

