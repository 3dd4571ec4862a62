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
import shutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFCoreTokenizer

from hpcdist.base.atomic import atomic_write, file_sha256
from hpcdist.byte_vocab import BYTE_BOS_ID, BYTE_EOS_ID, BYTE_TOKENS, BYTE_VOCAB
from hpcdist.config.dataset_meta import DataError, load_meta, read_meta_json
from hpcdist.data import corpora

__all__ = [
    "TOKENIZER_KINDS",
    "ByteTokenizer",
    "HFTokenizer",
    "SentencePieceTokenizer",
    "TiktokenTokenizer",
    "Tokenizer",
    "TokenizerError",
    "TokenizerKind",
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
    vocab_size = BYTE_VOCAB
    bos_id: int | None = BYTE_BOS_ID
    eos_id = BYTE_EOS_ID
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
        return arr[arr < BYTE_TOKENS].astype(np.uint8).tobytes().decode("utf-8", errors="replace")

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
            name=self._file.stem,
            pat_str=TIKTOKEN_PATTERN,
            mergeable_ranks=ranks,
            special_tokens={"<|endoftext|>": self.eos_id},
        )
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


# ---------------------------------------------------------------- Hugging Face form of each kind
BYTE_BOS, BYTE_EOS = "<s>", "</s>"  # the byte tokenizer's special tokens, named in its Hugging Face form
HFForm = tuple[dict[str, Any], dict[str, str]]  # (tokenizer_config.json, special_tokens_map.json)


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


def byte_tokenizer_json() -> HFCoreTokenizer:
    """A ``tokenizers`` tokenizer with ids equal to :class:`ByteTokenizer`'s: byte b -> b, BOS 256, EOS 257."""
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = HFCoreTokenizer(models.BPE(vocab=vocab, merges=[]))
    # no regex split: the whole text becomes its UTF-8 bytes, each one a token (no merges)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(BYTE_BOS, special=True), AddedToken(BYTE_EOS, special=True)])
    ids = (tok.token_to_id(BYTE_BOS), tok.token_to_id(BYTE_EOS))
    assert ids == (ByteTokenizer.bos_id, ByteTokenizer.eos_id), ids  # the ids are what the weights were trained on
    return tok


def _fast_config(bos: str | None, eos: str | None, max_len: int, extra: dict[str, Any]) -> dict[str, Any]:
    # PreTrainedTokenizerFast follows tokenizer.json as it is: model_type llama would otherwise pick LlamaTokenizer,
    # which adds BOS and a prefix space that the data was never prepared with
    return {
        **extra,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
    }


def _byte_hf(tok: Tokenizer, out: Path, max_len: int) -> HFForm:
    # no files: an equivalent tokenizer.json; split_special_tokens keeps a literal <s> in a text as bytes, as
    # ByteTokenizer does; invalid UTF-8 decodes to U+FFFD as in ByteTokenizer.decode
    atomic_write(out / "tokenizer.json", byte_tokenizer_json().to_str(pretty=True) + "\n")
    config = {**_fast_config(BYTE_BOS, BYTE_EOS, max_len, {}), "split_special_tokens": True}
    return config, {"bos_token": BYTE_BOS, "eos_token": BYTE_EOS}


def _hf_hf(tok: Tokenizer, out: Path, max_len: int) -> HFForm:
    # tokenizer.json copied, its tokenizer_config.json completed (class, BOS/EOS names)
    files = {f.name: f for f in tok.files()}
    core = HFCoreTokenizer.from_file(str(files["tokenizer.json"]))
    shutil.copyfile(files["tokenizer.json"], out / "tokenizer.json")
    extra = json.loads(files["tokenizer_config.json"].read_text()) if "tokenizer_config.json" in files else {}
    bos = core.id_to_token(tok.bos_id) if tok.bos_id is not None else None
    eos = core.id_to_token(tok.eos_id)
    pad = core.id_to_token(tok.pad_id) if tok.pad_id is not None else None
    config = _fast_config(bos, eos, max_len, extra)
    if pad is not None:
        config["pad_token"] = pad
    special = {k: v for k, v in (("bos_token", bos), ("eos_token", eos), ("pad_token", pad)) if v is not None}
    return config, special


def _sentencepiece_hf(tok: Tokenizer, out: Path, max_len: int) -> HFForm:
    # the .model copied as tokenizer.model: transformers' LlamaTokenizer loads it
    shutil.copyfile(tok.files()[0], out / "tokenizer.model")
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": max_len,
        "legacy": False,
    }
    return config, {}


# ---------------------------------------------------------------- the registry of tokenizer kinds
def _file_with(suffix: str, dir_file: str) -> Any:
    """recognise(): a file ending in ``suffix``, or a directory holding ``dir_file``."""

    def recognise(spec: str) -> list[Path] | None:
        path = Path(spec)
        if path.is_dir():
            return [path / dir_file] if (path / dir_file).is_file() else None
        return [path] if path.suffix == suffix and path.is_file() else None

    return recognise


def _tiktoken_spec(spec: str) -> list[Path] | None:
    if spec.startswith("tiktoken:"):
        return [Path(spec[len("tiktoken:") :])]
    return [Path(spec)] if spec.endswith(".tiktoken") and Path(spec).is_file() else None


def _named(files: list[Path], name: str) -> Path:
    """The file called ``name`` among a kind's files (a recorded tokenizer's come in meta.json's order), else the
    first."""
    return next((f for f in files if f.name == name), files[0])


@dataclass(frozen=True)
class TokenizerKind:
    """One tokenizer format: everything hpcdist knows about it. ``name`` is what meta.json records (``tokenizer.kind``);
    ``recognise(spec)`` gives the files a ``--tokenizer`` spec names when they are of this kind (None: not this kind);
    ``load(files)`` builds the tokenizer from them (the spec's, or the copies a prepared dataset recorded);
    ``export_hf(tok, out, max_len)`` writes its Hugging Face files into ``out`` and returns (tokenizer_config.json,
    special_tokens_map.json), or is None when the kind has no Hugging Face form. ``has_files``: False for a kind
    built from nothing (byte), which a prepared dataset records without files."""

    name: str
    recognise: Callable[[str], list[Path] | None]
    load: Callable[[list[Path]], Tokenizer]
    export_hf: Callable[[Tokenizer, Path, int], HFForm] | None
    has_files: bool = True


# Tried in this order on a spec; a file no kind recognises is read as a tokenizer.json under another name
# (FALLBACK_KIND).
# A new format is one entry here (and its class, here or in a module of its own).
_TOKENIZER_KINDS = (
    TokenizerKind(
        "byte",
        recognise=lambda spec: [] if spec == "byte" else None,
        load=lambda files: ByteTokenizer(),
        export_hf=_byte_hf,
        has_files=False,
    ),
    TokenizerKind("tiktoken", recognise=_tiktoken_spec, load=lambda files: TiktokenTokenizer(files[0]), export_hf=None),
    TokenizerKind(
        "hf",
        recognise=_file_with(".json", "tokenizer.json"),
        load=lambda files: HFTokenizer(_named(files, "tokenizer.json")),
        export_hf=_hf_hf,
    ),
    TokenizerKind(
        "sentencepiece",
        recognise=_file_with(".model", "tokenizer.model"),
        load=lambda files: SentencePieceTokenizer(files[0]),
        export_hf=_sentencepiece_hf,
    ),
)
TOKENIZER_KINDS: dict[str, TokenizerKind] = {k.name: k for k in _TOKENIZER_KINDS}
FALLBACK_KIND = "hf"


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """``byte``; a ``tokenizer.json`` or a directory with one; a SentencePiece ``.model`` (or a directory with
    ``tokenizer.model``); ``tiktoken:PATH`` or a ``*.tiktoken`` file; or a prepared dataset directory (the
    tokenizer it was prepared with). The kinds are :data:`TOKENIZER_KINDS`."""
    text = str(spec)
    path = Path(text)
    if path.is_dir():
        recorded = recorded_tokenizer(path)
        if recorded is not None:
            return recorded
    for kind in TOKENIZER_KINDS.values():
        files = kind.recognise(text)
        if files is not None:
            return kind.load(files)
    if path.is_dir():
        raise TokenizerError(f"{path}: a directory without tokenizer.json, tokenizer.model or a prepared dataset")
    if not path.is_file():
        raise TokenizerError(
            f"tokenizer {text!r}: no such file; give byte, a tokenizer.json (or its directory), a SentencePiece "
            ".model, tiktoken:PATH, or a prepared dataset directory"
        )
    return TOKENIZER_KINDS[FALLBACK_KIND].load([path])


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
    name = meta.tokenizer_kind
    if name not in TOKENIZER_KINDS:
        raise TokenizerError(f"{dataset_dir}: meta.json names an unknown tokenizer kind {name!r}")
    files = []
    for file_name, digest in meta.tokenizer.get("files", {}).items():
        file = Path(dataset_dir) / TOKENIZER_DIR / file_name
        if "/" in file_name or file_name in ("", ".", "..") or not file.is_file() or file.is_symlink():
            raise TokenizerError(
                f"{dataset_dir}: meta.json's tokenizer file {file_name!r} is not a regular file in "
                f"{TOKENIZER_DIR}/ (links are not followed); prepare the dataset again"
            )
        if file_sha256(file) != digest:
            raise TokenizerError(
                f"{file}: not the tokenizer file the dataset was prepared with (sha256 differs from "
                "meta.json's); restore it or prepare the dataset again"
            )
        files.append(file)
    if not files and TOKENIZER_KINDS[name].has_files:
        raise TokenizerError(f"{dataset_dir}: meta.json records a {name} tokenizer but no tokenizer file")
    return TOKENIZER_KINDS[name].load(files)


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
    if vocab_size <= BYTE_TOKENS + 1:
        raise ValueError(f"vocab_size must exceed the 256 byte tokens plus <|endoftext|>, got {vocab_size}")
    if not inputs:
        raise ValueError("no training inputs given")
    tok = HFCoreTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    docs = (_text(doc) for item in inputs for doc, _ in corpora.iter_documents(Path(item), text_field=text_field))
    tok.train_from_iterator(docs, trainer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "tokenizer.json", tok.to_str(pretty=True) + "\n")
    config = {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
    atomic_write(out / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")
    return HFTokenizer(out)
