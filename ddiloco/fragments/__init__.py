"""ddiloco.fragments."""
