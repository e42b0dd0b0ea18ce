"""ddiloco.checkpoint: orbax checkpoints of a learner (`learner.py`) and of the syncer (`syncer.py`)."""
