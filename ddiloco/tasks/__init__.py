"""ddiloco.tasks: what a run trains (model + loss + data + eval), behind one `Task` interface.

Importing this package registers `TextTask` and `VisionTask` with gin (module "ddiloco"), so a run
file binds `RunConfig.task = @VisionTask()`.
"""

import gin

from ddiloco.tasks.base import RESERVED_METRICS, Batch, LossOutput, Task
from ddiloco.tasks.text import TextTask
from ddiloco.tasks.vision import DEFAULT_MEAN_MERGED, VisionTask

gin.external_configurable(TextTask, module="ddiloco")
gin.external_configurable(VisionTask, module="ddiloco")

__all__ = [
  "DEFAULT_MEAN_MERGED",
  "RESERVED_METRICS",
  "Batch",
  "LossOutput",
  "Task",
  "TextTask",
  "VisionTask",
]
