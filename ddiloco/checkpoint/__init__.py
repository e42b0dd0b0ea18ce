"""ddiloco.checkpoint: orbax checkpoints of a learner (`learner.py`) and of the syncer (`syncer.py`);
the syncer's global model read back from its folders (`global_model.py`) and exported as Orbax or
Hugging Face files (`export.py`)."""
