"""ddiloco.distributed: the gRPC side of the distributed runtime.

The syncer service and its door (`service`, `door`; the service's collaborators in `streams`,
`merge_loop`, `publication`, `recovery`, `subscriptions`, `refusals` and `members`), the learner
worker (`worker`) and the multi-host learner (`multihost`): the threads, sockets and processes
around the pure `SyncerCore` and `Learner` (docs/architecture.md).
"""
