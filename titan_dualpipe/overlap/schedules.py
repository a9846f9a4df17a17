"""The schedules the package exports: the runtime's, with this package's runners.

The runtime never imports :mod:`titan_dualpipe.overlap`; it runs an overlapped pair and a lone
forward as sub-batches through the runners its schedule class carries
(``overlapped_pair_runner``, ``sub_batch_runner``), and builds the ``pair_first`` option's order with
its ``pair_order_class``. These subclasses give it :func:`.pair.run_pair_overlapped`,
:class:`.sub_batches.TwoBatchRunner` and :class:`.pair_first.PairFirst`.
"""

from __future__ import annotations

from ..runtime import schedules
from .pair import run_pair_overlapped
from .pair_first import PairFirst
from .sub_batches import TwoBatchRunner


class ScheduleDualPipeV(schedules.ScheduleDualPipeV):
    __doc__ = schedules.ScheduleDualPipeV.__doc__
    overlapped_pair_runner = staticmethod(run_pair_overlapped)
    sub_batch_runner = TwoBatchRunner
    pair_order_class = PairFirst


class ScheduleDualPipe(schedules.ScheduleDualPipe):
    __doc__ = schedules.ScheduleDualPipe.__doc__
    overlapped_pair_runner = staticmethod(run_pair_overlapped)
    sub_batch_runner = TwoBatchRunner
    pair_order_class = PairFirst
