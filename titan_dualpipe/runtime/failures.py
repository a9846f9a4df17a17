"""When a rank fails mid-step, every other rank's error names it.

A rank that raises inside ``step()`` records what happened in the process group's store under a
key of that step (:func:`step_scope`; the first record wins). A rank whose receive or send fails (its peer
closed the connection, or the group timeout passed) raises :class:`PeerFailed`, naming the peer
it waited for and the first failure any rank recorded, and records its own view when it is the
first. So a rank killed outright, which records nothing, is named by the neighbour that lost it,
and every rank further away names it too when its own wait ends.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Iterator

import torch.distributed as dist

from .._compat.c10d import default_store

_PREFIX = "titan_dualpipe/first_failure/"
_schedules_per_group: Counter[str] = Counter()


class PeerFailed(RuntimeError):
    """This rank's pipeline traffic failed because another rank stopped."""


def schedule_scope(group: dist.ProcessGroup | None) -> str:
    """A name for a new schedule on ``group``, the same on every rank (ranks build their
    schedules in the same order)."""
    name = group.group_name if group is not None else "default"
    _schedules_per_group[name] += 1
    return f"{name}/{_schedules_per_group[name]}"


def step_scope(schedule_scope: str, step: int) -> str:
    return f"{_PREFIX}{schedule_scope}/{step}"


def record(scope: str, text: str) -> None:
    """Record ``text`` as the step's first failure unless one is recorded already."""
    try:
        default_store().compare_set(scope, "", text)
    except Exception:  # noqa: BLE001 - the store may be gone with the failed rank; the error still stands
        pass


def first(scope: str) -> str:
    """The first failure recorded for this step, or ''."""
    try:
        store = default_store()
        return store.get(scope).decode() if store.check([scope]) else ""
    except Exception:  # noqa: BLE001
        return ""


def peer_failed(scope: str, text: str) -> PeerFailed:
    """A :class:`PeerFailed` for ``text`` (this rank's view), with the step's first failure."""
    record(scope, text)
    earliest = first(scope)
    return PeerFailed(text if not earliest or earliest == text else f"{text}. First failure in the pipeline: {earliest}")


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def root_cause(err: BaseException) -> BaseException:
    """The error torch's wrappers were raised from (a stage's own error, say)."""
    while err.__cause__ is not None:
        err = err.__cause__
    return err


@contextlib.contextmanager
def named_for_every_rank(scope: str, me: str, doing: str) -> Iterator[None]:
    """Run a block of a step whose failure every rank must hear of (``me``: "pipeline rank r (global
    rank g)", as the executor names a rank). The first failure is recorded; a rank whose block fails
    after another rank recorded one (its peer's connection closed under torch's own collectives,
    say) raises :class:`PeerFailed` naming that first failure."""
    try:
        yield
    except PeerFailed:
        raise
    except Exception as err:
        root = root_cause(err)
        text = f"{me} raised {type(root).__name__} {doing}: {first_line(root)}"
        record(scope, text)
        earliest = first(scope)
        if earliest and not earliest.startswith(me + " "):
            raise PeerFailed(f"{text}. First failure in the pipeline: {earliest}") from err
        raise
