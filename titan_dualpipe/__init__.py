"""DualPipe and DualPipeV pipeline-parallel schedules for ``torch.distributed.pipelining``.

- :func:`compute_order` - pure per-rank compute orders in torch's ``_Action`` IR.
- :class:`ScheduleDualPipeV`, :class:`ScheduleDualPipe` - runtime schedules
  (``PipelineScheduleMulti`` subclasses) driven with ``schedule.step()``.
"""

from .orders import SCHEDULES, compute_order, placement
from .runtime import PipelineConfigError, TimedAction
from .overlap.schedules import ScheduleDualPipe, ScheduleDualPipeV  # the runtime's, with the overlap runners

__all__ = ["PipelineConfigError", "SCHEDULES", "ScheduleDualPipe", "ScheduleDualPipeV", "TimedAction", "compute_order", "placement"]
__version__ = "0.1.0"
