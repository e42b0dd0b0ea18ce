"""Tests for ddiloco.data.tokenizers."""

import numpy as np
import pytest

from ddiloco.data import tokenizers


def test_byte_encode_hand_values():
  tok = tokenizers.get_tokenizer("byte")
  ids = tok.encode("Hi —")
  # "H" = 72, "i" = 105, " " = 32, the em dash U+2014 is UTF-8 E2 80 94 = 226 128 148.
  np.testing.assert_array_equal(ids, [72, 105, 32, 226, 128, 148])
  assert ids.dtype == np.int32
  assert tok.vocab_size == 256


def test_byte_round_trip_unicode():
  tok = tokenizers.ByteTokenizer()
  text = "To be, or not to be — that is the question.\nÉlan, naïve, 😀\n"
  ids = tok.encode(text)
  assert ids.min() >= 0 and ids.max() < 256
  assert len(ids) == len(text.encode("utf-8"))
  assert tok.decode(ids) == text
  assert tok.decode(ids.tolist()) == text  # Plain lists are accepted too.


def test_byte_decode_invalid_utf8_and_bad_ids():
  tok = tokenizers.ByteTokenizer()
  assert tok.decode([0xE2]) == "\ufffd"  # A truncated 3-byte character is replaced, not raised.
  assert tok.decode([]) == ""
  with pytest.raises(ValueError, match=r"\[0, 256\)"):
    tok.decode([65, 256])
  with pytest.raises(ValueError, match="1-D"):
    tok.decode(np.zeros((2, 2), np.int32))


def test_bpe_vocab_and_round_trip():
  tok = tokenizers.get_tokenizer("bpe")
  # cl100k_base: largest id is <|endofprompt|> = 100276, so 100277 ids.
  assert tok.vocab_size == 100277
  assert tok.encoding_name == tokenizers.BPE_ENCODING_NAME
  # Known cl100k ids: "hello" = 15339, " world" = 1917.
  np.testing.assert_array_equal(tok.encode("hello world"), [15339, 1917])
  text = "HAMLET:\nTo be, or not to be, that is the question:\nWhether 'tis nobler — é 😀\n"
  ids = tok.encode(text)
  assert ids.dtype == np.int32
  assert 0 < len(ids) < len(text)  # BPE compresses below one token per character.
  assert tok.decode(ids) == text


def test_bpe_special_token_text_is_ordinary():
  tok = tokenizers.BpeTokenizer()
  ids = tok.encode("<|endoftext|>")
  assert 100257 not in ids.tolist()  # 100257 is the <|endoftext|> control token.
  assert tok.decode(ids) == "<|endoftext|>"


def test_bpe_decode_rejects_bad_ids():
  tok = tokenizers.BpeTokenizer()
  with pytest.raises(ValueError, match="unassigned"):
    tok.decode([100265])  # Inside [0, vocab_size) but not assigned in cl100k.
  with pytest.raises(ValueError, match=r"\[0, 100277\)"):
    tok.decode([100277])


def test_get_tokenizer_names():
  assert isinstance(tokenizers.get_tokenizer("byte"), tokenizers.ByteTokenizer)
  for name in tokenizers.TOKENIZER_NAMES:
    assert isinstance(tokenizers.get_tokenizer(name), tokenizers.Tokenizer)
  with pytest.raises(ValueError, match="unknown tokenizer 'gpt2'"):
    tokenizers.get_tokenizer("gpt2")
