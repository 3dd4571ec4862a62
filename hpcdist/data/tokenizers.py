"""Tokenizers behind one small interface, all from local files (no model hub is reachable from the nodes).

* ``byte``: UTF-8 bytes 0..255 + BOS 256 + EOS 257 (the embedded demo's tokenizer; nothing to load).
* Hugging Face ``tokenizer.json`` (or a directory holding one), through the ``tokenizers`` library; special
  tokens come from ``tokenizer_config.json`` beside it when present, else from the usual names.
* SentencePiece ``.model`` (optional extra ``hpcdist[data]``).
* tiktoken from a local BPE ranks file (``*.tiktoken``, or ``tiktoken:PATH``; optional extra ``hpcdist[data]``).

:func:`load_tokenizer` turns a spec (``byte``, a path, or a prepared dataset directory, whose recorded tokenizer is
used) into a :class:`Tokenizer`; :func:`train_bpe` trains a byte-level BPE on local text.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from tokenizers import Tokenizer as HFCoreTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from hpcdist.atomic import atomic_write, file_sha256
from hpcdist.config.dataset_meta import DataError, load_meta, read_meta_json
from hpcdist.data import corpora

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "SentencePieceTokenizer",
    "TiktokenTokenizer",
    "Tokenizer",
    "TokenizerError",
    "load_tokenizer",
    "train_bpe",
]

TOKENIZER_DIR = "tokenizer"  # inside a prepared dataset: the copied tokenizer files
EXTRA = "pip install 'hpcdist[data]'"
# Special-token names of the common families, tried in order when no tokenizer_config.json names them.
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|bos|>", "[CLS]")
_EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eos|>", "[SEP]")
_PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]")
# tiktoken needs a pre-tokenization regex; a BPE file does not carry one. This is the GPT-4 (cl100k) pattern,
# the one Llama 3 uses too.
TIKTOKEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


class TokenizerError(ValueError):
    """A tokenizer spec that cannot be loaded: the message says what was expected."""


class Tokenizer(Protocol):
    """What preparation, training and export need from a tokenizer."""

    kind: str
    vocab_size: int
    bos_id: int | None
    eos_id: int
    pad_id: int | None

    @property
    def add_bos(self) -> bool:
        """Whether preparation starts each document with BOS (when the tokenizer has one)."""
        ...

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        """Token ids of each text, without special tokens."""
        ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of ``ids``, special tokens dropped."""
        ...

    def files(self) -> list[Path]:
        """The local files this tokenizer is loaded from (copied next to prepared data)."""
        ...


def _text(t: str | bytes) -> str:
    # Byte inputs (raw text files) meet a text tokenizer: invalid UTF-8 becomes U+FFFD rather than an error, and so
    # does a lone surrogate in a str (a JSON "\ud800", an undecodable byte of a command line)
    return t.decode("utf-8", errors="replace") if isinstance(t, bytes) else corpora.without_surrogates(t)


def _ids_array(ids: Sequence[int]) -> np.ndarray:
    return np.asarray(ids, dtype=np.int64)


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus BOS (256) and EOS (257). No training, no files, any input."""

    kind = "byte"
    vocab_size = 258
    bos_id: int | None = 256
    eos_id = 257
    pad_id: int | None = None
    # The demo's token stream predates BOS framing: documents are separated by EOS only.
    add_bos = False

    def encode(self, text: str | bytes, *, bos: bool = False, eos: bool = True) -> np.ndarray:
        """Token ids (uint16) of the UTF-8 bytes of `text`, optionally framed by BOS / EOS."""
        data = _text(text).encode("utf-8") if isinstance(text, str) else bytes(text)
        ids = np.empty(len(data) + int(bos) + int(eos), dtype=np.uint16)
        start = int(bos)
        ids[start : start + len(data)] = np.frombuffer(data, dtype=np.uint8)
        if bos:
            ids[0] = self.bos_id
        if eos:
            ids[-1] = self.eos_id
        return ids

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        return [self.encode(t, eos=False).astype(np.int64) for t in texts]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of `ids`; BOS/EOS are dropped and invalid UTF-8 (e.g. a cut multi-byte char) becomes U+FFFD."""
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}), got min {arr.min()} max {arr.max()}")
        return arr[arr < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def files(self) -> list[Path]:
        return []


def _special_from_config(path: Path) -> dict[str, str]:
    """bos/eos/pad token strings named by a transformers ``tokenizer_config.json`` (a str or {"content": str})."""
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    out = {}
    for key in ("bos_token", "eos_token", "pad_token"):
        v = cfg.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str):
            out[key] = v
    return out


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` through the ``tokenizers`` library (no ``transformers`` needed)."""

    kind = "hf"

    def __init__(self, path: Path) -> None:
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise TokenizerError(f"{path}: no tokenizer.json there")
        try:
            self._tok = HFCoreTokenizer.from_file(str(file))
        except Exception as e:  # the library raises a plain Exception on a malformed file
            raise TokenizerError(f"{file}: not a Hugging Face tokenizer.json ({e})") from e
        self._file = file
        self._config = file.parent / "tokenizer_config.json"
        named = _special_from_config(self._config) if self._config.is_file() else {}
        vocab = self._tok.get_vocab(with_added_tokens=True)
        # ids can exceed the reported size in hand-edited files: the embedding table must cover the largest one
        self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)

        def pick(key: str, names: Iterable[str]) -> int | None:
            if key in named:
                return vocab.get(named[key])
            return next((vocab[n] for n in names if n in vocab), None)

        self.bos_id = pick("bos_token", _BOS_NAMES)
        eos = pick("eos_token", _EOS_NAMES)
        if eos is None:
            raise TokenizerError(
                f"{file}: no end-of-text token found (tried {', '.join(_EOS_NAMES)}); documents are separated by "
                "EOS: add one, or name it as eos_token in tokenizer_config.json beside tokenizer.json"
            )
        self.eos_id = eos
        self.pad_id = pick("pad_token", _PAD_NAMES)

    @property
    def add_bos(self) -> bool:
        return self.bos_id is not None

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        # encode_batch_fast skips the offsets we never use
        encodings = self._tok.encode_batch_fast([_text(t) for t in texts], add_special_tokens=False)
        return [_ids_array(e.ids) for e in encodings]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._tok.decode([int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=True)

    def files(self) -> list[Path]:
        return [self._file] + ([self._config] if self._config.is_file() else [])


class SentencePieceTokenizer:
    """A SentencePiece ``.model`` file (optional extra: ``hpcdist[data]``)."""

    kind = "sentencepiece"

    def __init__(self, path: Path) -> None:
        # optional dependency, imported only when a .model file is used
        try:
            import sentencepiece
        except ImportError as e:
            raise TokenizerError(f"{path}: SentencePiece tokenizers need the sentencepiece package: {EXTRA}") from e
        self._file = Path(path)
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=str(self._file))
        except (OSError, RuntimeError) as e:
            raise TokenizerError(f"{path}: not a SentencePiece model ({e})") from e
        self.vocab_size = int(self._sp.get_piece_size())
        self.bos_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
        if self._sp.eos_id() < 0:
            raise TokenizerError(f"{path}: the SentencePiece model has no EOS piece (eos_id=-1)")
        self.eos_id = int(self._sp.eos_id())
        self.pad_id = self._sp.pad_id() if self._sp.pad_id() >= 0 else None

    @property
    def add_bos(self) -> bool:
        return self.bos_id is not None

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        return [_ids_array(ids) for ids in self._sp.encode([_text(t) for t in texts])]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._sp.decode([int(i) for i in np.asarray(ids).reshape(-1)])

    def files(self) -> list[Path]:
        return [self._file]


class TiktokenTokenizer:
    """tiktoken over a local BPE ranks file (base64 token + rank per line; optional extra ``hpcdist[data]``).

    The file carries no special tokens: ``<|endoftext|>`` (EOS) is added after the last rank."""

    kind = "tiktoken"

    def __init__(self, path: Path) -> None:
        # optional dependency, imported only when a tiktoken file is used
        try:
            import tiktoken
            from tiktoken.load import load_tiktoken_bpe
        except ImportError as e:
            raise TokenizerError(f"{path}: tiktoken tokenizers need the tiktoken package: {EXTRA}") from e
        self._file = Path(path)
        try:
            ranks = load_tiktoken_bpe(str(self._file))
        except (OSError, ValueError) as e:
            raise TokenizerError(f"{path}: not a tiktoken BPE file ({e})") from e
        self.eos_id = max(ranks.values()) + 1
        self._enc = tiktoken.Encoding(
            name=self._file.stem, pat_str=TIKTOKEN_PATTERN, mergeable_ranks=ranks,
            special_tokens={"<|endoftext|>": self.eos_id},
        )  # fmt: skip
        self.vocab_size = self.eos_id + 1
        self.bos_id = None
        self.pad_id = None

    add_bos = False

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        # one thread: preparation parallelizes over processes
        return [_ids_array(ids) for ids in self._enc.encode_ordinary_batch([_text(t) for t in texts], num_threads=1)]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._enc.decode([int(i) for i in np.asarray(ids).reshape(-1) if int(i) != self.eos_id])

    def files(self) -> list[Path]:
        return [self._file]


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """``byte``; a ``tokenizer.json`` or a directory with one; a SentencePiece ``.model`` (or a directory with
    ``tokenizer.model``); ``tiktoken:PATH`` or a ``*.tiktoken`` file; or a prepared dataset directory (the
    tokenizer it was prepared with)."""
    text = str(spec)
    if text == "byte":
        return ByteTokenizer()
    if text.startswith("tiktoken:"):
        return TiktokenTokenizer(Path(text[len("tiktoken:") :]))
    path = Path(text)
    if path.is_dir():
        recorded = recorded_tokenizer(path)
        if recorded is not None:
            return recorded
        if (path / "tokenizer.json").is_file():
            return HFTokenizer(path)
        if (path / "tokenizer.model").is_file():
            return SentencePieceTokenizer(path / "tokenizer.model")
        raise TokenizerError(f"{path}: a directory without tokenizer.json, tokenizer.model or a prepared dataset")
    if not path.is_file():
        raise TokenizerError(
            f"tokenizer {text!r}: no such file; give byte, a tokenizer.json (or its directory), a SentencePiece "
            ".model, tiktoken:PATH, or a prepared dataset directory"
        )
    if path.suffix == ".model":
        return SentencePieceTokenizer(path)
    if path.suffix == ".tiktoken":
        return TiktokenTokenizer(path)
    return HFTokenizer(path)


def recorded_tokenizer(dataset_dir: Path) -> Tokenizer | None:
    """The tokenizer a prepared dataset records (meta.json ``tokenizer`` + its copied files), or None when the
    directory holds no meta.json. A damaged meta.json, or recorded files that are missing, links, or not the ones
    recorded (sha256), raise TokenizerError."""
    doc, why = read_meta_json(Path(dataset_dir))
    if doc is None and why == "no meta.json":
        return None
    try:
        meta = load_meta(dataset_dir, key="tokenizer")
    except DataError as e:
        raise TokenizerError(str(e)) from None
    if meta.tokenizer is None:
        # datasets from before tokenizers were recorded were all byte-level
        return ByteTokenizer() if meta.vocab_size == ByteTokenizer.vocab_size else None
    kind = meta.tokenizer.get("kind", "byte")
    if kind == "byte":
        return ByteTokenizer()
    loaders: dict[str, Any] = {"hf": HFTokenizer, "sentencepiece": SentencePieceTokenizer,
                               "tiktoken": TiktokenTokenizer}  # fmt: skip
    if kind not in loaders:
        raise TokenizerError(f"{dataset_dir}: meta.json names an unknown tokenizer kind {kind!r}")
    files = []
    for name, digest in meta.tokenizer.get("files", {}).items():
        file = Path(dataset_dir) / TOKENIZER_DIR / name
        if "/" in name or name in ("", ".", "..") or not file.is_file() or file.is_symlink():
            raise TokenizerError(f"{dataset_dir}: meta.json's tokenizer file {name!r} is not a regular file in "
                                 f"{TOKENIZER_DIR}/ (links are not followed); prepare the dataset again")  # fmt: skip
        if file_sha256(file) != digest:
            raise TokenizerError(f"{file}: not the tokenizer file the dataset was prepared with (sha256 differs from "
                                 "meta.json's); restore it or prepare the dataset again")  # fmt: skip
        files.append(file)
    if not files:
        raise TokenizerError(f"{dataset_dir}: meta.json records a {kind} tokenizer but no tokenizer file")
    return loaders[kind](files[0])


def describe(tok: Tokenizer) -> dict[str, Any]:
    """What meta.json records: kind, sizes, special ids, and each file's sha256 (its fingerprint)."""
    return {
        "kind": tok.kind,
        "vocab_size": int(tok.vocab_size),
        "bos_id": tok.bos_id,
        "eos_id": int(tok.eos_id),
        "pad_id": tok.pad_id,
        "add_bos": bool(tok.add_bos),
        "files": {f.name: file_sha256(f) for f in tok.files()},
    }


def copy_files(tok: Tokenizer, dataset_dir: Path) -> None:
    """Copy the tokenizer's files into ``dataset_dir/tokenizer/`` so the data carries what made it."""
    files = tok.files()
    if not files:
        return
    dest = Path(dataset_dir) / TOKENIZER_DIR
    for f in files:
        if f.resolve() != (dest / f.name).resolve():
            atomic_write(dest / f.name, f.read_bytes())  # a killed prepare never leaves half a tokenizer


def train_bpe(
    inputs: Sequence[Path], *, vocab_size: int, out_dir: Path, text_field: str = "text", min_frequency: int = 2
) -> HFTokenizer:
    """Train a byte-level BPE (GPT-2 style: lossless on any text) on local documents (any input
    :func:`hpcdist.data.corpora.iter_documents` reads); writes ``out_dir/tokenizer.json`` and a
    ``tokenizer_config.json`` naming ``<|endoftext|>`` as EOS and padding."""
    if vocab_size < 257 + 1:
        raise ValueError(f"vocab_size must exceed the 256 byte tokens plus <|endoftext|>, got {vocab_size}")
    if not inputs:
        raise ValueError("no training inputs given")
    tok = HFCoreTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    docs = (_text(doc) for item in inputs for doc, _ in corpora.iter_documents(Path(item), text_field=text_field))
    tok.train_from_iterator(docs, trainer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "tokenizer.json", tok.to_str(pretty=True) + "\n")
    config = {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
    atomic_write(out / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")
    return HFTokenizer(out)
