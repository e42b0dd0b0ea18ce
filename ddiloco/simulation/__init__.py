"""ddiloco.simulation."""
