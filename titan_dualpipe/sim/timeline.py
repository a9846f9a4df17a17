"""Timelines: per-rank action records, drawn as a picture or written as a Chrome/Perfetto trace.

A timeline is a list of :class:`~titan_dualpipe.runtime.timeline.TimedAction` ``(rank, action,
start, end, sub_batches)``; the simulator produces one, and a measured run records the same shape. :func:`draw_timeline` needs
matplotlib (``pip install 'titan_dualpipe[plot]'``); :func:`write_trace` needs nothing.

An action whose microbatch ran as two sub-batches (two-batch overlap, ``sub_batches``) is named with a
``½`` suffix (``F3½``, ``B3½``) in traces (and has ``sub_batches`` in its args) and is drawn as two
stacked half-height cells.
"""

from __future__ import annotations

import json
from typing import Callable, Iterable

from .._compat.pipelining import B, F, I, OVERLAP_F_B, W, _Action
from ..orders.lowering import leaf_actions
from ..runtime.timeline import TimedAction

StageDirection = Callable[[int], int]
# (rank, start, end, kind): a span drawn in a thin strip under the rank's row (``profile --moe``:
# kind "exposed", the measured exchange waits; "floor", the idle times of the least-exposure order)
Mark = tuple[int, float, float, str]
_MARK_STYLE = {"exposed": ("#c0392b", 0.42, "exposed (measured)"),
               "floor": ("#222222", 0.51, "exposed at the floor")}  # colour, offset below the row's middle
_MARK_HEIGHT = 0.08


SUB_BATCHES = "½"  # label suffix of an action run on two sub-batches of its microbatch


def action_label(action: _Action, sub_batches: bool = False) -> str:
    """Short label: ``F3``, ``B5``, ``I2``, ``W2``; a pair is ``F3&B5``; ``F3½`` on two sub-batches."""
    label = "&".join(f"{leaf.computation_type.value}{_microbatch(leaf)}" for leaf in leaf_actions(action))
    return label + SUB_BATCHES if sub_batches else label


def _microbatch(action: _Action) -> str:
    return "" if action.microbatch_index is None else str(action.microbatch_index)


def action_kind(action: _Action) -> str:
    """``F``, ``B``, ``I``, ``W`` or ``F&B`` for an overlapped pair."""
    return "F&B" if action.computation_type == OVERLAP_F_B else action.computation_type.value


# ---- Chrome / Perfetto trace -------------------------------------------------------------


def trace_events(events: Iterable[TimedAction], us_per_unit: float = 1000.0) -> dict:
    """The timeline as a Chrome trace object: one process per rank, one complete event per action.

    ``us_per_unit`` converts the timeline's time unit to the trace's microseconds (1000: one
    simulator unit shows as 1 ms; 1e6 for times in seconds).
    """
    events = list(events)
    records: list[dict] = []
    for rank in sorted({e.rank for e in events}):
        records.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        records.append({"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}})
    for e in sorted(events, key=lambda e: (e.rank, e.start)):
        records.append({
            "name": action_label(e.action, e.sub_batches),
            "cat": action_kind(e.action),
            "ph": "X",
            "pid": e.rank,
            "tid": 0,
            "ts": e.start * us_per_unit,
            "dur": (e.end - e.start) * us_per_unit,
            "args": {"action": str(e.action), "stages": [leaf.stage_index for leaf in leaf_actions(e.action)],
                     "sub_batches": e.sub_batches},
        })
    return {"traceEvents": records, "displayTimeUnit": "ms"}


def write_trace(events: Iterable[TimedAction], path: str, us_per_unit: float = 1000.0) -> None:
    """Write :func:`trace_events` as JSON (open it in ui.perfetto.dev or chrome://tracing)."""
    with open(path, "w") as f:
        json.dump(trace_events(events, us_per_unit), f)


# ---- picture ------------------------------------------------------------------------------

# (direction 0, direction 1) colours per leaf kind; direction 1 is a lighter shade.
_COLOURS = {
    F: ("#f29e4c", "#fbd5b0"),
    B: ("#4c8bd6", "#b5d0f0"),
    I: ("#3fae7a", "#b0e0c8"),
    W: ("#9b6fc3", "#d9c6ea"),
}
_ROW_HEIGHT = 0.8
_SUB_BATCH_GAP = 0.06  # white band between the two sub-batches of a split action's cell
_SUB_BATCH_ROWS = (((_ROW_HEIGHT - _SUB_BATCH_GAP) / 2, 0.0), ((_ROW_HEIGHT - _SUB_BATCH_GAP) / 2, (_ROW_HEIGHT + _SUB_BATCH_GAP) / 2))


def _import_pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError(
            "drawing a schedule needs matplotlib: pip install 'titan_dualpipe[plot]' (or pip install matplotlib)."
        ) from None
    return plt


def draw_timeline(
    events: Iterable[TimedAction],
    path: str,
    title: str = "",
    direction_of: StageDirection | None = None,
    direction_label: str = "direction 1",
    time_label: str = "time",
    marks: Iterable[Mark] | None = None,
) -> None:
    """Draw one row per rank, time on x, one cell per action; write it to ``path`` (png, svg, pdf).

    Cells are coloured by kind (F, B, I, W) with the microbatch inside; an overlapped pair is
    one outlined box split into its F and B halves; an action on two sub-batches of its microbatch
    (``sub_batches``) two stacked half-height cells. ``direction_of(stage)`` (0 or 1) picks a
    lighter, hatched shade for 1 (e.g. DualPipe's second chain: ``Placement.chain_of``),
    named ``direction_label`` in the legend. Gaps are bubbles. ``marks`` (same clock as the
    events) are drawn as thin bars under their rank's row, one strip per kind.
    """
    plt = _import_pyplot()
    events = list(events)
    if not events:
        raise ValueError("the timeline is empty: nothing to draw.")
    direction_of = direction_of or (lambda stage: 0)
    origin = min(e.start for e in events)  # measured clocks start anywhere; show time since the first action
    events = [e._replace(start=e.start - origin, end=e.end - origin) for e in events]
    ranks = sorted({e.rank for e in events})
    start, end = 0.0, max(e.end for e in events)
    fig_width = min(60.0, max(8.0, 0.28 * len(events) / len(ranks) + 2))
    fig, ax = plt.subplots(figsize=(fig_width, 0.55 * len(ranks) + 1.6))
    points_per_unit = fig_width * 0.85 * 72 / (end or 1.0)
    font = _cell_font_size(events, points_per_unit)
    for e in events:
        _draw_action(ax, e, ranks.index(e.rank), direction_of, font, points_per_unit)
    marks = [(rank, a - origin, b - origin, kind) for rank, a, b, kind in marks or () if rank in ranks]
    _draw_marks(ax, marks, ranks)
    _style_axes(ax, ranks, (start, end), title, time_label)
    if marks:  # room for the last rank's strips
        ax.set_ylim(len(ranks) - 0.5 + 2 * _MARK_HEIGHT, -0.5)
    handles = _legend_handles(events, direction_of, direction_label) + _mark_handles(marks)
    rows = 2 if marks else 1  # the marks' entries are long: the legend on two rows
    legend_height = 0.45 * rows  # inches kept free under the axes for the legend
    fig.legend(handles=handles, loc="lower center", ncol=-(-len(handles) // rows), frameon=False,
               handler_map={_SubBatchesHandle: _SubBatchesHandler()})
    fig.tight_layout(rect=(0, legend_height / fig.get_figheight(), 1, 1))
    fig.savefig(path, dpi=130)
    plt.close(fig)


def _draw_marks(ax, marks: list[Mark], ranks: list[int]) -> None:
    from matplotlib.patches import Rectangle

    for rank, a, b, kind in marks:
        colour, offset, _ = _MARK_STYLE[kind]
        ax.add_patch(Rectangle((a, ranks.index(rank) + offset), b - a, _MARK_HEIGHT, facecolor=colour,
                               edgecolor="none"))


def _mark_handles(marks: list[Mark]) -> list:
    from matplotlib.patches import Patch

    kinds = {kind for *_, kind in marks}
    return [Patch(facecolor=colour, label=label) for kind, (colour, _, label) in _MARK_STYLE.items() if kind in kinds]


def _style_axes(ax, ranks: list[int], span: tuple[float, float], title: str, time_label: str) -> None:
    ax.set_xlim(*span)
    ax.set_ylim(len(ranks) - 0.5, -0.5)  # rank 0 on top
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.tick_params(axis="y", length=0)
    ax.set_xlabel(time_label)
    ax.set_title(title, fontsize=11)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)


def _legend_handles(events: list[TimedAction], direction_of: StageDirection, direction_label: str) -> list:
    """Legend entries for what the picture shows, and nothing else."""
    from matplotlib.patches import Patch

    leaves = [leaf for e in events for leaf in leaf_actions(e.action)]
    kinds = {leaf.computation_type for leaf in leaves}
    handles = [Patch(facecolor=_COLOURS[k][0], edgecolor="black", label=k.value) for k in (F, B, I, W) if k in kinds]
    if any(e.action.computation_type == OVERLAP_F_B for e in events):
        handles.append(Patch(facecolor="white", edgecolor="black", linewidth=2, label="F&B overlapped"))
    if any(e.sub_batches for e in events):
        handles.append(_SubBatchesHandle(label=f"two sub-batches ({SUB_BATCHES})"))
    if any(direction_of(leaf.stage_index) for leaf in leaves):
        handles.append(Patch(facecolor=_COLOURS[F][1], edgecolor="grey", hatch="//", label=direction_label))
    return handles


def _cell_font_size(events: list[TimedAction], points_per_unit: float) -> float:
    """A size at which a typical cell fits a two-digit microbatch number."""
    widths = sorted((e.end - e.start) / len(leaf_actions(e.action)) for e in events)
    typical = widths[len(widths) // 2] * points_per_unit
    return max(4.0, min(9.0, typical / 1.9))


def _draw_action(ax, event: TimedAction, row: int, direction_of: StageDirection, font: float,
                 points_per_unit: float) -> None:
    leaves = leaf_actions(event.action)
    width = (event.end - event.start) / len(leaves)
    top = row - _ROW_HEIGHT / 2
    for i, leaf in enumerate(leaves):
        direction = min(direction_of(leaf.stage_index), 1)
        x = event.start + i * width
        for height, offset in _SUB_BATCH_ROWS if event.sub_batches else ((_ROW_HEIGHT, 0.0),):
            ax.add_patch(_cell(x, top + offset, width, leaf, direction, height))
        if width * points_per_unit >= 1.2 * font:  # no label on slivers
            ax.text(x + width / 2, row, _microbatch(leaf), ha="center", va="center", fontsize=font)
    if len(leaves) > 1:
        from matplotlib.patches import Rectangle

        # Inset a little so two adjacent pairs keep separate outlines.
        inset = 0.1 * width
        ax.add_patch(Rectangle((event.start + inset, top), event.end - event.start - 2 * inset, _ROW_HEIGHT,
                               fill=False, edgecolor="black", linewidth=1.8, zorder=3))


def _cell(x: float, top: float, width: float, leaf: _Action, direction: int, height: float = _ROW_HEIGHT):
    from matplotlib.patches import Rectangle

    colour = _COLOURS.get(leaf.computation_type, ("#999999", "#dddddd"))[direction]
    return Rectangle((x, top), width, height, facecolor=colour, edgecolor="white" if not direction else "grey",
                     linewidth=0.6, hatch="//" if direction else None)


class _SubBatchesHandle:
    """Legend entry for actions on two sub-batches (drawn by :class:`_SubBatchesHandler`)."""

    def __init__(self, label: str) -> None:
        self.label = label

    def get_label(self) -> str:
        return self.label


class _SubBatchesHandler:
    """Draws a :class:`_SubBatchesHandle` as two stacked grey bars, like a split action's cell."""

    def legend_artist(self, legend, handle: _SubBatchesHandle, fontsize: float, handlebox):
        from matplotlib.patches import Rectangle

        x, y, w, h = -handlebox.xdescent, -handlebox.ydescent, handlebox.width, handlebox.height
        bars = [Rectangle((x, y + offset), w, 0.42 * h, facecolor="#888888", edgecolor="none",
                          transform=handlebox.get_transform()) for offset in (0.0, 0.58 * h)]
        for bar in bars:
            handlebox.add_artist(bar)
        return bars[0]
