"""Test set-up: fake CPU devices must be configured before jax is imported anywhere; the tiers."""

import os
import tempfile

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# Many tests compile the same tiny programs from new jit objects; the persistent cache turns those
# recompiles into cache hits (keyed by the program, so a stale entry can never be wrong).
os.environ.setdefault(
  "JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "ddiloco-test-jax-cache")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# The tiers (fast by default, integration, e2e) and the fast tier's guard against real sockets and
# processes; pytester runs the guard's own tests in a pytest run of their own.
pytest_plugins = ("ddiloco.testing.tiers", "pytester")
