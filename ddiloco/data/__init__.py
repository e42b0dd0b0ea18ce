"""ddiloco.data."""
