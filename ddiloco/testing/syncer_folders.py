"""A syncer's folder as a run leaves it, made without a run: checkpoints, merge journal, version log.

`write_syncer_folder` publishes given values as versions the way the syncer's runtime does
(launch/runtime.py): each version's values go to the version log, then its line to the journal;
a checkpoint of the whole core is saved after the versions in `checkpointed`, and the versions in
`later` are published after it (the merges a kill between two checkpoints would leave to the log).
"""

import os
from collections.abc import Collection, Mapping, Sequence

import numpy as np

from ddiloco.checkpoint import syncer as ckpt_lib
from ddiloco.fragments.digest import values_digest
from ddiloco.fragments.layout import FragmentLayout
from ddiloco.syncer.core import SyncerConfig, SyncerCore

Versions = Mapping[int, Sequence[Mapping[str, np.ndarray]]]  # {fragment: values of v1, v2, ...}


def write_syncer_folder(
  folder: str,
  layout: FragmentLayout,
  init: Mapping[str, np.ndarray],
  *,
  checkpointed: Versions,
  later: Versions = {},  # noqa: B006  (read only)
  owned: Collection[int] | None = None,
  version_log: bool = True,
  checkpoints: int = 1,
  subdir: str = "checkpoints",
) -> SyncerCore:
  """Writes a syncer folder; returns the core as it ends (every version published).

  Args:
    folder: the syncer's folder (created).
    layout: the fragment layout.
    init: version 0 of every key the syncer owns (layout keys).
    checkpointed: new versions of fragments (values keyed as the layout keys them), published
      before the checkpoint.
    later: versions published after the last checkpoint.
    owned: the fragments this syncer owns (a shard's: p mod S == s); None: all.
    version_log: write the version log.
    checkpoints: checkpoints saved: the first after the first version of each fragment in
      `checkpointed`, ..., the last after all of them (steps 1, 2, ...).
    subdir: the checkpoints' folder (`SyncerCheckpointConfig.subdir`).
  """
  os.makedirs(folder, exist_ok=True)
  core = SyncerCore(
    fragment_keys=layout.fragments,
    init_values=init,
    config=SyncerConfig(use_grace=False),
    clock=lambda: 0.0,
    owned=owned,
  )
  journal = ckpt_lib.MergeJournal(os.path.join(folder, ckpt_lib.JOURNAL_NAME))
  log = ckpt_lib.VersionLog(os.path.join(folder, ckpt_lib.VERSION_LOG_DIR)) if version_log else None
  checkpointer = ckpt_lib.SyncerCheckpointer(os.path.join(folder, subdir), max_to_keep=8)

  def publish(p: int, values: Mapping[str, np.ndarray]) -> None:
    values = {k: np.asarray(v) for k, v in values.items()}
    digest = values_digest(values)
    version = core.version(p) + 1
    core.recover(p, version, values, digest)
    if log is not None:
      log.write(p, version, values, digest)
    journal.record(p, version, digest)

  try:
    rounds = max((len(v) for v in checkpointed.values()), default=0)
    saves = sorted({round(rounds * (i + 1) / checkpoints) for i in range(checkpoints)})
    for r in range(rounds):
      for p, versions in sorted(checkpointed.items()):
        if r < len(versions):
          publish(p, versions[r])
      if r + 1 in saves:
        checkpointer.save(saves.index(r + 1) + 1, core.state_dict())
        checkpointer.wait()
    if rounds == 0:
      checkpointer.save(1, core.state_dict())
    for p, versions in sorted(later.items()):
      for values in versions:
        publish(p, values)
  finally:
    checkpointer.close()
    journal.close()
  return core
