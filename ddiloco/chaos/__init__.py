"""ddiloco.chaos: the chaos harness's schedule, loopback proxy, event tape, invariants and replay."""
