"""ddiloco.learner."""
