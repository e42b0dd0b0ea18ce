"""ddiloco.chaos: the chaos harness: its driver on a local cluster and programs, loopback proxy,
event tape, invariants and replay (its fault schedules are `ddiloco.faults.schedule`)."""
