"""ddiloco.transport."""
