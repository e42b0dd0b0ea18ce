"""ddiloco.fragments: flat parameter views, fragment layouts, the streaming schedule, wire codecs.

docs/algorithm.md §2 (layouts, schedule), §4.7 (digests), §5 (compression).
"""

from ddiloco.fragments.compression import (
  CODECS,
  Codec,
  Encoded,
  codec_class,
  decode_fragment,
  encode_fragment,
  fragment_wire_bytes,
  get_codec,
  register,
)
from ddiloco.fragments.digest import values_digest
from ddiloco.fragments.layout import STRATEGIES, FragmentLayout, make_layout, parse_key
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.fragments.tree import flatten, path_str, unflatten

__all__ = [
  "CODECS",
  "STRATEGIES",
  "Codec",
  "Encoded",
  "FragmentLayout",
  "FragmentSchedule",
  "codec_class",
  "decode_fragment",
  "encode_fragment",
  "flatten",
  "fragment_wire_bytes",
  "get_codec",
  "make_layout",
  "parse_key",
  "path_str",
  "register",
  "unflatten",
  "values_digest",
]
