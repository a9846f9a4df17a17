"""Runtime schedules and the executor that runs their lowered orders."""

from .executor import StepExecutor, TimedAction
from .schedules import ScheduleDualPipe, ScheduleDualPipeV

__all__ = ["ScheduleDualPipe", "ScheduleDualPipeV", "StepExecutor", "TimedAction"]
