"""ddiloco.metrics."""
