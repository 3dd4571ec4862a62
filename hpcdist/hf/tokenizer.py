"""A run's tokenizer as Hugging Face tokenizer files, so ``AutoTokenizer.from_pretrained(dir)`` encodes and decodes
like hpcdist did.

Each tokenizer kind says how it is written (``export_hf``, its entry in
:data:`hpcdist.data.tokenizers.TOKENIZER_KINDS`):

* ``byte`` (256 byte tokens, BOS 256, EOS 257) has no files: an equivalent ``tokenizer.json`` is built with the
  ``tokenizers`` library: a BPE without merges over the byte-level alphabet (byte b is token b), the special tokens
  at 256 and 257, and the byte-level decoder (invalid UTF-8 becomes U+FFFD as in ``ByteTokenizer.decode``).
  ``split_special_tokens`` keeps a literal ``<s>`` in a text as bytes, as ``ByteTokenizer`` does.
* a Hugging Face ``tokenizer.json`` is copied, its ``tokenizer_config.json`` completed (class, BOS/EOS names).
* SentencePiece: the ``.model`` is copied as ``tokenizer.model`` (loaded by transformers' ``LlamaTokenizer``).
* tiktoken BPE files have no Hugging Face form here: refused with the fix (``--tokenizer``).

This module writes the two JSON files every kind has (``tokenizer_config.json``, ``special_tokens_map.json``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hpcdist.base.atomic import atomic_write
from hpcdist.data.tokenizers import TOKENIZER_KINDS, Tokenizer, TokenizerError

__all__ = ["export_tokenizer"]


def _write_json(path: Path, data: dict[str, Any]) -> None:
    atomic_write(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def export_tokenizer(tok: Tokenizer, out: Path, *, max_len: int) -> list[str]:
    """Write ``tok`` into the Hugging Face directory ``out``; the file names written."""
    kind = TOKENIZER_KINDS.get(tok.kind)
    if kind is None or kind.export_hf is None:
        raise TokenizerError(
            f"a {tok.kind} tokenizer has no Hugging Face form here: pass --tokenizer SPEC (byte, a "
            "tokenizer.json or its directory) or --no-tokenizer"
        )
    config, special = kind.export_hf(tok, out, max_len)
    _write_json(out / "tokenizer_config.json", config)
    _write_json(out / "special_tokens_map.json", special)
    return sorted(p.name for p in out.iterdir() if p.name.startswith(("tokenizer", "special_tokens")))
