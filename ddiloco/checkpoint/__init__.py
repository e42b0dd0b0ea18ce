"""ddiloco.checkpoint."""
