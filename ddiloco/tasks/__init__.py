"""ddiloco.tasks: what a run trains (model + loss + data + eval), behind one `Task` interface.

The entry points register `TextTask`, `TokenShardTask` and `VisionTask` with gin as
`ddiloco.TextTask`, `ddiloco.TokenShardTask` and `ddiloco.VisionTask`
(ddiloco/launch/configurables.py), so a run file binds `RunConfig.task = @VisionTask()`.
"""

from ddiloco.tasks.base import RESERVED_METRICS, Batch, LossOutput, Task
from ddiloco.tasks.text import TextTask, TokenShardTask
from ddiloco.tasks.vision import DEFAULT_MEAN_MERGED, VisionTask

__all__ = [
  "DEFAULT_MEAN_MERGED",
  "RESERVED_METRICS",
  "Batch",
  "LossOutput",
  "Task",
  "TextTask",
  "TokenShardTask",
  "VisionTask",
]
