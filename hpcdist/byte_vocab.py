"""The byte tokenizer's ids, their one owner: UTF-8 bytes 0..255 are tokens 0..255, then BOS and EOS.

Standard library only, and outside every package: the config checks the data's vocabulary before torch is imported,
the model's default vocabulary is the byte tokenizer's, and the tokenizers themselves (hpcdist.data.tokenizers) build
the byte tokenizer from these numbers."""

from __future__ import annotations

__all__ = ["BYTE_BOS_ID", "BYTE_EOS_ID", "BYTE_TOKENS", "BYTE_VOCAB"]

BYTE_TOKENS = 256
"""One token per byte value."""
BYTE_BOS_ID = BYTE_TOKENS
BYTE_EOS_ID = BYTE_TOKENS + 1
BYTE_VOCAB = BYTE_TOKENS + 2
"""256 bytes + BOS + EOS: the byte tokenizer's vocabulary, and the model's default ``vocab_size``."""
