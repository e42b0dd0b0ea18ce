"""ddiloco.fragments: flat parameter views, fragment layouts, the streaming schedule, wire codecs.

docs/algorithm.md §2 (layouts, schedule), §4.7 (digests), §5 (compression).
"""

from ddiloco.fragments.codec import Codec, register
from ddiloco.fragments.compression import CODECS, codec_class, get_codec
from ddiloco.fragments.digest import values_digest
from ddiloco.fragments.layout import STRATEGIES, FragmentLayout, make_layout, parse_key
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.fragments.tree import flatten, path_str, unflatten

__all__ = [
  "CODECS",
  "STRATEGIES",
  "Codec",
  "FragmentLayout",
  "FragmentSchedule",
  "codec_class",
  "flatten",
  "get_codec",
  "make_layout",
  "parse_key",
  "path_str",
  "register",
  "unflatten",
  "values_digest",
]
