"""ddiloco.syncer."""
