"""ddiloco.data: tokenizers and checkpointable grain pipelines over shipped text (no downloads)."""

from ddiloco.data.text import (
  PlaySpan,
  TextDataConfig,
  TextTrainIterator,
  clean_markdown,
  eval_batches,
  make_train_iterator,
  num_windows,
  play_spans,
  shakespeare_plays,
  shard_window_ids,
  token_stream,
  tokens_per_batch,
)
from ddiloco.data.tokenizers import BpeTokenizer, ByteTokenizer, Tokenizer, get_tokenizer

__all__ = [
  "BpeTokenizer",
  "ByteTokenizer",
  "PlaySpan",
  "TextDataConfig",
  "TextTrainIterator",
  "Tokenizer",
  "clean_markdown",
  "eval_batches",
  "get_tokenizer",
  "make_train_iterator",
  "num_windows",
  "play_spans",
  "shakespeare_plays",
  "shard_window_ids",
  "token_stream",
  "tokens_per_batch",
]
