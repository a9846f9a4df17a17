"""Runtime schedules and the executor that runs their lowered orders."""

from .timeline import TimedAction
from .executor import StepExecutor
from .schedules import ScheduleDualPipe, ScheduleDualPipeV

__all__ = ["ScheduleDualPipe", "ScheduleDualPipeV", "StepExecutor", "TimedAction"]
