"""Cost-model simulator of pipeline schedules, and pictures/traces of timelines.

- :mod:`.costs`: :class:`Costs` (F, B, W, FB, F2, B2 per action) and :func:`parse_costs`.
- :mod:`.schedules`: :class:`Pipeline` (order + stage chains) for our schedules, torch's
  built-ins (orders built without a process group) and torch-format CSV files.
- :mod:`.engine`: :func:`simulate`, an event-driven run of every rank's order.
- :mod:`.two_batch`: which actions two-batch overlap runs on two halves, and their costs.
- :mod:`.timeline`: :class:`TimedAction` records, :func:`draw_timeline`, :func:`write_trace`;
  they take any timeline, simulated or measured.

``SimResult.to_json()`` (``titan-dualpipe simulate --json``) holds the keys below.
"""

from __future__ import annotations

JSON_KEYS_HELP = """\
JSON keys (simulate --json; with --compare, one object per schedule under "schedules",
plus "cost_scale", or {"schedule", "error"} for a schedule that cannot run these sizes):
  schedule                   schedule name (csv:FILE for --csv)
  pp                         pipeline ranks
  microbatches               microbatches per step
  num_stages                 stages in all chains together
  costs                      per-action costs used: F, B, W, I (= B - W), FB; F2, B2 where given
  p2p                        latency added to each cross-rank hand-off
  two_batch                  lone forwards and their lone backwards ran on two halves (F2, B2)
  makespan                   time from the first action start to the last action end
  busy_per_rank              sum of action times, per rank
  bubble_per_rank            makespan - busy, per rank
  bubble_ratio_per_rank      bubble / makespan, per rank
  bubble_ratio               all ranks' bubble / (pp * makespan)
  max_bubble                 largest per-rank bubble (the figure of DeepSeek's bubble table)
  peak_activations_per_rank  most live stage-microbatch activations at once, per rank
                             (+1 at F; -1 at B, or at W when the backward is split into I + W;
                             at I where a split microbatch's backward runs whole there)
  peak_activations           largest of peak_activations_per_rank
  actions_per_rank           entries run per rank (an overlapped F&B pair counts once)
"""

__doc__ += "\n" + JSON_KEYS_HELP

from .costs import Costs, parse_costs  # noqa: E402
from .engine import RankStats, SimResult, simulate  # noqa: E402
from .schedules import SCHEDULE_NAMES, Pipeline, pipeline_for, pipeline_from_csv  # noqa: E402
from .timeline import TimedAction, draw_timeline, trace_events, write_trace  # noqa: E402

__all__ = [
    "JSON_KEYS_HELP",
    "Costs",
    "Pipeline",
    "RankStats",
    "SCHEDULE_NAMES",
    "SimResult",
    "TimedAction",
    "draw_timeline",
    "parse_costs",
    "pipeline_for",
    "pipeline_from_csv",
    "simulate",
    "trace_events",
    "write_trace",
]
