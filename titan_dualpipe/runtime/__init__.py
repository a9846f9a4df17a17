"""Runtime schedules and the executor that runs their lowered orders."""

from .errors import PipelineConfigError
from .timeline import TimedAction
from .executor import StepExecutor
from .schedules import ScheduleDualPipe, ScheduleDualPipeV

__all__ = ["PipelineConfigError", "ScheduleDualPipe", "ScheduleDualPipeV", "StepExecutor", "TimedAction"]
