"""ddiloco.learner_process: a learner process's side of the distributed runtime.

The learner worker (`worker`: its training thread in `training` and `step_wait`, its senders,
listener threads and session), its link to the syncer (`link`, over one client or a sharded
syncer's `shard_client`) and the multi-host learner (`multihost`): the threads, sockets and
processes around the pure `Learner` (docs/architecture.md).
"""
