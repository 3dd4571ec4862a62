"""A run's tokenizer as Hugging Face tokenizer files, so ``AutoTokenizer.from_pretrained(dir)`` encodes and decodes
like hpcdist did.

* ``byte`` (256 byte tokens, BOS 256, EOS 257) has no files: an equivalent ``tokenizer.json`` is built with the
  ``tokenizers`` library: a BPE without merges over the byte-level alphabet (byte b is token b), the special tokens
  at 256 and 257, and the byte-level decoder (invalid UTF-8 becomes U+FFFD as in ``ByteTokenizer.decode``).
  ``split_special_tokens`` keeps a literal ``<s>`` in a text as bytes, as ``ByteTokenizer`` does.
* a Hugging Face ``tokenizer.json`` is copied, its ``tokenizer_config.json`` completed (class, BOS/EOS names).
* SentencePiece: the ``.model`` is copied as ``tokenizer.model`` (loaded by transformers' ``LlamaTokenizer``).
* tiktoken BPE files have no Hugging Face form here: refused with the fix (``--tokenizer``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as CoreTokenizer

from hpcdist.atomic import atomic_write
from hpcdist.data.tokenizers import ByteTokenizer, Tokenizer, TokenizerError

__all__ = ["byte_tokenizer_json", "export_tokenizer"]

BYTE_BOS, BYTE_EOS = "<s>", "</s>"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the alphabet of the ``ByteLevel`` pre-tokenizer and decoder."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_tokenizer_json() -> CoreTokenizer:
    """A ``tokenizers`` tokenizer with ids equal to :class:`ByteTokenizer`'s: byte b -> b, BOS 256, EOS 257."""
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = CoreTokenizer(models.BPE(vocab=vocab, merges=[]))
    # no regex split: the whole text becomes its UTF-8 bytes, each one a token (no merges)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(BYTE_BOS, special=True), AddedToken(BYTE_EOS, special=True)])
    ids = (tok.token_to_id(BYTE_BOS), tok.token_to_id(BYTE_EOS))
    assert ids == (ByteTokenizer.bos_id, ByteTokenizer.eos_id), ids  # the ids are what the weights were trained on
    return tok


def _config(bos: str | None, eos: str | None, max_len: int, extra: dict[str, Any]) -> dict[str, Any]:
    # PreTrainedTokenizerFast follows tokenizer.json as it is: model_type llama would otherwise pick LlamaTokenizer,
    # which adds BOS and a prefix space that the data was never prepared with
    return {**extra, "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
            "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
            "model_max_length": max_len}  # fmt: skip


def _write_json(path: Path, data: dict[str, Any]) -> None:
    atomic_write(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def export_tokenizer(tok: Tokenizer, out: Path, *, max_len: int) -> list[str]:
    """Write ``tok`` into the Hugging Face directory ``out``; the file names written."""
    if tok.kind == "byte":
        atomic_write(out / "tokenizer.json", byte_tokenizer_json().to_str(pretty=True) + "\n")
        config = {**_config(BYTE_BOS, BYTE_EOS, max_len, {}), "split_special_tokens": True}
        special = {"bos_token": BYTE_BOS, "eos_token": BYTE_EOS}
    elif tok.kind == "hf":
        files = {f.name: f for f in tok.files()}
        core = CoreTokenizer.from_file(str(files["tokenizer.json"]))
        shutil.copyfile(files["tokenizer.json"], out / "tokenizer.json")
        extra = json.loads(files["tokenizer_config.json"].read_text()) if "tokenizer_config.json" in files else {}
        bos = core.id_to_token(tok.bos_id) if tok.bos_id is not None else None
        eos = core.id_to_token(tok.eos_id)
        pad = core.id_to_token(tok.pad_id) if tok.pad_id is not None else None
        config = _config(bos, eos, max_len, extra)
        special = {k: v for k, v in (("bos_token", bos), ("eos_token", eos), ("pad_token", pad)) if v is not None}
        if pad is not None:
            config["pad_token"] = pad
    elif tok.kind == "sentencepiece":
        shutil.copyfile(tok.files()[0], out / "tokenizer.model")
        config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": False, "add_eos_token": False,
                  "model_max_length": max_len, "legacy": False}  # fmt: skip
        special = {}
    else:
        raise TokenizerError(f"a {tok.kind} tokenizer has no Hugging Face form here: pass --tokenizer SPEC (byte, a "
                             "tokenizer.json or its directory) or --no-tokenizer")  # fmt: skip
    _write_json(out / "tokenizer_config.json", config)
    _write_json(out / "special_tokens_map.json", special)
    return sorted(p.name for p in out.iterdir() if p.name.startswith(("tokenizer", "special_tokens")))
