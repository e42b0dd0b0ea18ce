"""The wire codecs by name and by wire id: `CODECS`, `get_codec`, `codec_class` (docs/algorithm.md §5).

The codecs themselves are in `codecs` (registered when it is imported, here), their interface
and registry in `codec`.
"""

from ddiloco.fragments import codecs  # noqa: F401  (registers fp32, bf16, int8, int4)
from ddiloco.fragments.codec import REGISTRY, Codec

# The registered codecs' names, in wire-id order.
CODECS = tuple(c.name for c in sorted(REGISTRY.values(), key=lambda c: c.wire_id))


def codec_class(name: str) -> type[Codec]:
  """The registered codec class called `name`.

  Raises:
    ValueError: on an unknown name.
  """
  try:
    return REGISTRY[name]
  except KeyError:
    raise ValueError(f"Unknown codec {name!r}; expected one of {CODECS}.") from None


def codec_by_wire_id(wire_id: int) -> type[Codec]:
  """The registered codec class whose wire id is `wire_id`.

  Raises:
    ValueError: on an unknown id.
  """
  for cls in REGISTRY.values():
    if cls.wire_id == wire_id:
      return cls
  raise ValueError(f"Unknown codec id {wire_id}; the registered ids are 0..{len(CODECS) - 1}.")


def get_codec(name: str, block_size: int = 64) -> Codec:
  """Returns the codec `name` (one of `CODECS`: "fp32", "bf16", "int8", "int4").

  Raises:
    ValueError: on an unknown name or block_size < 1.
  """
  return codec_class(name)(block_size=block_size)
