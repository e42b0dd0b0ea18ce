"""A pre-tokenized corpus on disk: ArrayRecord files of fixed-length token windows.

A corpus folder holds `tokens.json` (what the files are) and, per split ("train", "eval"),
`<split>-<i>-of-<n>.array_record` files whose records are windows of `window_len` = L + 1 token
ids, stored as little-endian `uint16` (vocabularies up to 65,536) or `uint32`, one record per
window. Example i of a split is record i of its files taken in order. `write_corpus` writes one
from windows (any tokenizer: the ids are the caller's), `write_text_corpus` from text files with a
tokenizer that ships with a package (data/tokenizers.py; scripts/write_token_shards.py is its
command line). data/token_shards.py reads it for training.

tokens.json: {"format": "ddiloco.token_shards", "version": 1, "window_len", "vocab_size",
"dtype", "tokenizer", "splits": {"train": {"files": [...], "examples": N}, "eval": {...}}}.
"""

import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from ddiloco.data import tokenizers

META_NAME = "tokens.json"
FORMAT = "ddiloco.token_shards"
FORMAT_VERSION = 1
SPLITS = ("train", "eval")
# A record per window, read one at a time: ArrayRecord's advice for random access.
_WRITER_OPTIONS = "group_size:1"


@dataclasses.dataclass(frozen=True)
class CorpusInfo:
  """What `tokens.json` says about a corpus folder.

  Attributes:
    path: the folder.
    window_len: tokens per record (L + 1).
    vocab_size: every id is below it.
    dtype: the stored ids' dtype ("uint16" or "uint32").
    tokenizer: the tokenizer that wrote it (informational: "byte", "bpe", or the writer's name).
    files: {split: its files, in example order}.
    examples: {split: its number of windows}.
    fingerprint: a digest of the above: an iterator state names the corpus it was read from.
  """

  path: str
  window_len: int
  vocab_size: int
  dtype: str
  tokenizer: str
  files: Mapping[str, tuple[str, ...]]
  examples: Mapping[str, int]
  fingerprint: str

  @property
  def seq_len(self) -> int:
    return self.window_len - 1


def read_info(path: str) -> CorpusInfo:
  """The corpus in folder `path`.

  Raises:
    FileNotFoundError: without `tokens.json`, or a file it lists.
    ValueError: for another format, or a split without windows.
  """
  meta_path = os.path.join(path, META_NAME)
  if not os.path.isfile(meta_path):
    raise FileNotFoundError(
      f"{path} holds no {META_NAME}: not a token corpus (write one with "
      "scripts/write_token_shards.py)."
    )
  with open(meta_path) as f:
    text = f.read()
  meta = json.loads(text)
  if meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
    raise ValueError(f"{meta_path} is not a {FORMAT} v{FORMAT_VERSION} description.")
  files, examples = {}, {}
  for split in SPLITS:
    entry = meta["splits"].get(split)
    if not entry or entry["examples"] < 1:
      raise ValueError(f"{path} has no {split} windows.")
    files[split] = tuple(os.path.join(path, name) for name in entry["files"])
    examples[split] = int(entry["examples"])
    missing = [f for f in files[split] if not os.path.isfile(f)]
    if missing:
      raise FileNotFoundError(f"{path} lacks {[os.path.basename(f) for f in missing[:3]]}.")
  return CorpusInfo(
    path=path,
    window_len=int(meta["window_len"]),
    vocab_size=int(meta["vocab_size"]),
    dtype=str(meta["dtype"]),
    tokenizer=str(meta.get("tokenizer", "")),
    files=files,
    examples=examples,
    fingerprint=hashlib.sha256(text.encode()).hexdigest()[:16],
  )


# -- writing ------------------------------------------------------------------------------------


def id_dtype(vocab_size: int) -> np.dtype:
  """The narrowest stored dtype for ids below `vocab_size`."""
  return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def write_corpus(
  out: str,
  windows: Mapping[str, Iterable[np.ndarray]],
  *,
  vocab_size: int,
  tokenizer: str,
  examples_per_file: int = 1 << 16,
) -> CorpusInfo:
  """Writes a corpus folder from each split's windows (1-D id arrays of one common length).

  The files are written into a hidden folder beside `out`, renamed to `out` once complete: a
  failure leaves nothing half-written.

  Args:
    out: the folder; must not exist, or be empty.
    windows: {"train": ..., "eval": ...}, each an iterable of windows in example order.
    vocab_size: every id must be below it.
    tokenizer: recorded in `tokens.json`.
    examples_per_file: windows per ArrayRecord file.

  Raises:
    ValueError: for windows of different lengths, an id out of range, or an empty split.
    FileExistsError: if `out` holds something.
  """
  out = os.path.abspath(out)
  if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
    raise FileExistsError(
      f"{out} exists and is not an empty folder: write the corpus to a new one."
    )
  parent, name = os.path.split(out)
  os.makedirs(parent, exist_ok=True)
  stage = tempfile.mkdtemp(prefix=f".{name}.", suffix=".partial", dir=parent)
  try:
    splits = {
      split: _write_split(stage, split, windows[split], vocab_size, examples_per_file)
      for split in SPLITS
    }
    lengths = {length for _, _, length in splits.values()}
    if len(lengths) != 1:
      raise ValueError(f"The splits' windows differ in length: {sorted(lengths)}.")
    meta = {
      "format": FORMAT,
      "version": FORMAT_VERSION,
      "window_len": lengths.pop(),
      "vocab_size": vocab_size,
      "dtype": id_dtype(vocab_size).name,
      "tokenizer": tokenizer,
      "splits": {s: {"files": files, "examples": n} for s, (files, n, _) in splits.items()},
    }
    with open(os.path.join(stage, META_NAME), "w") as f:
      json.dump(meta, f, indent=1)
    os.rename(stage, out)  # Replaces an empty folder.
  finally:
    shutil.rmtree(stage, ignore_errors=True)
  return read_info(out)


def _write_split(
  folder: str, split: str, windows: Iterable[np.ndarray], vocab_size: int, per_file: int
) -> tuple[list[str], int, int]:
  """Writes one split's windows; returns (its files, its window count, the window length)."""
  from array_record.python.array_record_module import ArrayRecordWriter

  dtype = id_dtype(vocab_size).newbyteorder("<")
  names, count, length, writer = [], 0, None, None
  try:
    for given in windows:
      window = np.asarray(given)
      if window.ndim != 1 or (length is not None and window.size != length):
        raise ValueError(f"Windows must be 1-D of one length; got shape {window.shape}.")
      if window.size < 2 or window.min() < 0 or window.max() >= vocab_size:
        raise ValueError(f"A {split} window has ids outside [0, {vocab_size}) or < 2 tokens.")
      length = window.size
      if count % per_file == 0:
        if writer is not None:
          writer.close()
        names.append(f"{split}-{len(names):05d}.array_record")
        writer = ArrayRecordWriter(os.path.join(folder, names[-1]), _WRITER_OPTIONS)
      writer.write(window.astype(dtype).tobytes())
      count += 1
  finally:
    if writer is not None:
      writer.close()
  if count == 0:
    raise ValueError(f"No {split} windows to write (too little text for windows of this length?).")
  # The final names say how many files there are, as sharded datasets name theirs.
  final = [f"{split}-{i:05d}-of-{len(names):05d}.array_record" for i in range(len(names))]
  for old, new in zip(names, final):
    os.replace(os.path.join(folder, old), os.path.join(folder, new))
  return final, count, length


def text_windows(
  texts: Iterable[str], tokenizer: tokenizers.Tokenizer, *, seq_len: int, eval_fraction: float
) -> dict[str, list[np.ndarray]]:
  """{"train", "eval"} windows of L + 1 tokens of documents, split as the Shakespeare pipeline
  splits its plays: the last `eval_fraction` of each document's tokens is held out, and each
  split's stream (its documents' parts, concatenated) is cut into non-overlapping windows."""
  if not 0 < eval_fraction < 1:
    raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}.")
  parts: dict[str, list[np.ndarray]] = {"train": [], "eval": []}
  for text in texts:
    ids = tokenizer.encode(text)
    cut = len(ids) - int(np.ceil(eval_fraction * len(ids)))
    parts["train"].append(ids[:cut])
    parts["eval"].append(ids[cut:])
  out = {}
  for split, pieces in parts.items():
    stream = np.concatenate(pieces) if pieces else np.zeros(0, np.int64)
    n = len(stream) // (seq_len + 1)
    out[split] = list(stream[: n * (seq_len + 1)].reshape(n, seq_len + 1))
  return out


def write_text_corpus(
  out: str,
  paths: Sequence[str],
  *,
  tokenizer: str = "byte",
  seq_len: int = 128,
  eval_fraction: float = 0.05,
  examples_per_file: int = 1 << 16,
) -> CorpusInfo:
  """Tokenizes UTF-8 text files (one document each) and writes them as a corpus folder.

  Args:
    out: the corpus folder.
    paths: the text files.
    tokenizer: "byte" or "bpe" (data/tokenizers.py: nothing is downloaded).
    seq_len: L; windows hold L + 1 tokens.
    eval_fraction: the held-out tail of every document.
    examples_per_file: windows per ArrayRecord file.
  """
  tok = tokenizers.get_tokenizer(tokenizer)
  texts = (pathlib.Path(p).read_text(encoding="utf-8") for p in paths)
  windows = text_windows(texts, tok, seq_len=seq_len, eval_fraction=eval_fraction)
  return write_corpus(
    out,
    windows,
    vocab_size=tok.vocab_size,
    tokenizer=tokenizer,
    examples_per_file=examples_per_file,
  )
