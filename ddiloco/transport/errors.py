"""The transport's error type."""


class WireError(ValueError):
  """Malformed, inconsistent or oversized data from the wire.

  A ValueError, so callers that validate with ValueError catch it; the service maps it to
  INVALID_ARGUMENT and never lets the data touch the global state (docs/architecture.md).
  """


class WireSizeError(WireError):
  """Data larger than a limit allows (a payload, a chunk): the service answers RESOURCE_EXHAUSTED."""
