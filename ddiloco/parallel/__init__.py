"""ddiloco.parallel."""
