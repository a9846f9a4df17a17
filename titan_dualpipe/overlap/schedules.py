"""The schedules the package exports: the runtime's, with this package's runners.

The runtime never imports :mod:`titan_dualpipe.overlap`; it runs an overlapped pair and a lone
forward as sub-batches through the runners its schedule class carries
(``overlapped_pair_runner``, ``sub_batch_runner``). These subclasses give it
:func:`.pair.run_pair_overlapped` and :class:`.sub_batches.TwoBatchRunner`.
"""

from __future__ import annotations

from ..runtime import schedules
from .pair import run_pair_overlapped
from .sub_batches import TwoBatchRunner


class ScheduleDualPipeV(schedules.ScheduleDualPipeV):
    __doc__ = schedules.ScheduleDualPipeV.__doc__
    overlapped_pair_runner = staticmethod(run_pair_overlapped)
    sub_batch_runner = TwoBatchRunner


class ScheduleDualPipe(schedules.ScheduleDualPipe):
    __doc__ = schedules.ScheduleDualPipe.__doc__
    overlapped_pair_runner = staticmethod(run_pair_overlapped)
    sub_batch_runner = TwoBatchRunner
