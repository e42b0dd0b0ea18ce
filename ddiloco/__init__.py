"""ddiloco: Decoupled DiLoCo for resilient distributed pre-training, in JAX."""

__version__ = "0.1.0"
