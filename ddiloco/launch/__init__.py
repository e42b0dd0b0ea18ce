"""ddiloco.launch."""
