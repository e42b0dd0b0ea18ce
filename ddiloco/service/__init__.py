"""ddiloco.service: the syncer service, the threads and sockets around the pure `SyncerCore`.

The service and its door (`service`, `door`; the service's collaborators in `streams`,
`merge_loop`, `publication`, `recovery`, `subscriptions`, `refusals`, `members` and `downlink`),
the gRPC server and its bulk port (`server`, `bulk_server`), and the service on a virtual clock
that the simulated cluster talks to (`virtual`) (docs/architecture.md).
"""
