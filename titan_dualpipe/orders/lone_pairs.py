"""Lone actions paired with each other: the warm-up's and cool-down's actions without a partner.

DualPipe pairs the forward of one microbatch with the backward of another; what runs before the
first pair and after the last runs alone, every exchange of it exposed. Where two such actions of
one direction stand next to each other on a rank (two forwards, or two backwards: ``B`` or ``I``)
and neither feeds the other, :func:`pair_lone_actions` puts them into one ``OVERLAP_F_B`` entry
(torch's container of overlapped sub-actions, which torch's own runtime runs one after the other),
so a relay can hide each one's exchanges behind the other's compute.

A pair waits for both inputs before it starts, and its first action's output leaves later than
alone: a pair is kept only where the order still runs. The order runs while its graph (each
rank's actions in order, and each output to the action it feeds) has no cycle, so two adjacent
actions can be paired unless the second's input depends on the first's output through other
actions (:class:`_Graph`). Pure: a function of the order and its placement.
"""

from __future__ import annotations

from .._compat.pipelining import B, F, I, OVERLAP_F_B, _Action
from .dataflow import input_source
from .lowering import leaf_actions
from .placement import Placement

_BACKWARDS = (B, I)


def lone_pair(first: _Action, second: _Action) -> _Action:
    """The overlapped entry of two lone actions, ``first`` starting."""
    return _Action(-1, OVERLAP_F_B, None, (first, second))


def is_lone_pair(action: _Action | None) -> bool:
    """Whether ``action`` is a pair of two actions of one direction (not a forward with a backward)."""
    if action is None or action.computation_type != OVERLAP_F_B or action.sub_actions is None:
        return False
    kinds = [a.computation_type for a in action.sub_actions]
    return kinds[0] == F and kinds[1] == F or kinds[0] in _BACKWARDS and kinds[1] in _BACKWARDS


def pairable(first: _Action | None, second: _Action | None, place: Placement) -> bool:
    """Whether two adjacent actions of a rank can run as a lone pair: both forwards or both
    backwards (``B`` or ``I``), neither a pair already, and the first not feeding the second."""
    if first is None or second is None or first.sub_actions is not None or second.sub_actions is not None:
        return False
    a, b = first.computation_type, second.computation_type
    if a == F and b == F:
        feeds = place.next_stage(first.stage_index) == second.stage_index
    elif a in _BACKWARDS and b in _BACKWARDS:
        feeds = place.prev_stage(first.stage_index) == second.stage_index
    else:
        return False
    return not (feeds and first.microbatch_index == second.microbatch_index)


def pair_lone_actions(order: dict[int, list[_Action]], place: Placement) -> dict[int, list[_Action]]:
    """``order`` with adjacent lone actions of one direction paired (module docstring): each
    rank from its start, greedily, every pair kept only where the whole order still runs."""
    out = {rank: list(actions) for rank, actions in order.items()}
    graph = _Graph(out, place)
    for rank in sorted(out):
        i = 0
        while i + 1 < len(out[rank]):
            first, second = out[rank][i], out[rank][i + 1]
            if pairable(first, second, place) and not graph.feeds_through_others(first, second):
                graph.merge(first, second)
                out[rank][i:i + 2] = [lone_pair(first, second)]
            i += 1
    return out


class _Graph:
    """The order's dependencies between its entries: each rank's entries in turn, and each output
    to the entry it feeds. Nodes are entries (a pair is one node), numbered by their first leaf."""

    def __init__(self, order: dict[int, list[_Action]], place: Placement) -> None:
        ranks = [[a for a in actions if a is not None] for actions in order.values()]
        self._id = {leaf: i for i, leaf in enumerate(leaf for entries in ranks for e in entries
                                                      for leaf in leaf_actions(e))}
        self._node = list(range(len(self._id)))  # leaf -> its entry's node
        self._leaves = [[i] for i in range(len(self._id))]  # node -> its leaves
        self._next: dict[int, int] = {}  # node -> the rank's next node
        self._prev: dict[int, int] = {}
        for entries in ranks:
            nodes = [self._id[leaf_actions(e)[0]] for e in entries]
            for e, node in zip(entries, nodes):
                for leaf in leaf_actions(e):
                    self._node[self._id[leaf]] = node
                self._leaves[node] = [self._id[leaf] for leaf in leaf_actions(e)]
            self._next.update(zip(nodes, nodes[1:]))
            self._prev.update(zip(nodes[1:], nodes))
        self._consumers: list[list[int]] = [[] for _ in self._id]  # leaf -> the leaves its output feeds
        self._producers: list[list[int]] = [[] for _ in self._id]
        for leaf, i in self._id.items():
            source = input_source(leaf, place)
            for kind in source.kinds if source is not None else ():
                producer = self._id.get(_Action(source.stage, kind, leaf.microbatch_index))
                if producer is not None:
                    self._consumers[producer].append(i)
                    self._producers[i].append(producer)

    def feeds_through_others(self, first: _Action, second: _Action) -> bool:
        """Whether ``second`` (right after ``first`` on its rank) depends on ``first`` other than by
        following it: pairing them would make the order wait on itself. Searches from both ends at
        once, the smaller side first, so a pair early or late in the step looks at little."""
        a, b = self._id[first], self._id[second]
        ahead = {self._node[c] for c in self._consumers[a]}  # reached from first's outputs
        behind = {self._node[p] for p in self._producers[b]}  # reaching second's inputs
        if ahead & behind:
            return True
        sides = [(ahead, list(ahead), self._next, self._consumers), (behind, list(behind), self._prev, self._producers)]
        while sides[0][1] and sides[1][1]:
            seen, frontier, along_rank, data = min(sides, key=lambda side: len(side[1]))
            other = sides[1] if seen is sides[0][0] else sides[0]
            grown = []
            for node in frontier:
                linked = [self._node[j] for leaf in self._leaves[node] for j in data[leaf]]
                if node in along_rank:
                    linked.append(along_rank[node])
                for n in linked:
                    if n in other[0]:
                        return True
                    if n not in seen:
                        seen.add(n)
                        grown.append(n)
            frontier[:] = grown
        return False

    def merge(self, first: _Action, second: _Action) -> None:
        """``first`` and ``second``, adjacent on their rank, now run as one entry."""
        a, b = self._node[self._id[first]], self._node[self._id[second]]
        for leaf in self._leaves[b]:
            self._node[leaf] = a
        self._leaves[a] += self._leaves[b]
        del self._next[a], self._prev[b]
        following = self._next.pop(b, None)
        if following is not None:
            self._next[a], self._prev[following] = following, a
