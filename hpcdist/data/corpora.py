"""Where documents come from: text files, jsonl / jsonl.gz, parquet, and Hugging Face ``datasets`` directories.

Each reader yields ``(document, n_bytes)``: the text (``bytes`` for plain text files, read raw so any encoding
reaches the byte tokenizer unchanged; ``str`` otherwise) and how many input bytes it came from, for MB/s.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import sysconfig
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = ["CorpusError", "expand_inputs", "input_files", "input_kind", "iter_documents", "stdlib_corpus"]

EXTRA = "pip install 'hpcdist[data]'"
# One JSON line (one document) is read whole: a bound keeps a file without newlines from filling the memory.
MAX_LINE_BYTES = 256 * 2**20
# A lone UTF-16 surrogate ("\ud800" in JSON) is valid JSON but not text: no tokenizer can encode it.
_SURROGATE = re.compile("[\ud800-\udfff]")


class CorpusError(ValueError):
    """An input that cannot be read as documents: the message names the file and the fix."""


def stdlib_corpus() -> list[Path]:
    """The default corpus: this interpreter's own standard-library ``*.py`` files, sorted.

    Every Python install carries it, so the demo trains on real text with no download (compute nodes often
    have no internet). Third-party packages (site-packages / dist-packages) are excluded because they differ
    between machines; sorting makes the token stream identical wherever the same Python runs.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files: list[Path] = []
    # os.walk does not follow directory symlinks, so a link loop cannot hang us.
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip]
        for name in filenames:
            path = Path(dirpath) / name
            if name.endswith(".py") and path.is_file():
                files.append(path)
    return sorted(files)


def is_hf_dataset_dir(path: Path) -> bool:
    """A directory written by ``datasets``' ``save_to_disk`` (a Dataset or a DatasetDict)."""
    if not path.is_dir():
        return False
    saved_dataset = all((path / f).is_file() for f in ("state.json", "dataset_info.json"))
    return saved_dataset or (path / "dataset_dict.json").is_file()


def input_kind(path: Path) -> str:
    """hf_dataset, jsonl, jsonl.gz, parquet or text (anything else: one document per file)."""
    if is_hf_dataset_dir(path):
        return "hf_dataset"
    name = path.name.lower()
    if name.endswith((".jsonl.gz", ".json.gz", ".ndjson.gz")):
        return "jsonl.gz"
    if name.endswith((".jsonl", ".ndjson")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


def check_glob(glob: str) -> None:
    """A --glob pattern must match names below the directory searched: no absolute path, no ``..``."""
    parts = Path(glob).parts
    if not glob or Path(glob).is_absolute() or ".." in parts or glob.startswith("~"):
        raise CorpusError(
            f"--glob {glob!r}: give patterns relative to the input directories (like *.txt or "
            "sub/*.jsonl), not a path: name other files as inputs"
        )


def expand_inputs(inputs: Sequence[Path], glob: str) -> list[Path]:
    """Files and dataset directories to read, in a stable order: a directory is searched recursively with `glob`,
    except a ``datasets`` directory, which is one input. Raises CorpusError for a missing path or a bad pattern."""
    check_glob(glob)
    out: list[Path] = []
    for item in inputs:
        item = Path(item)
        if is_hf_dataset_dir(item):
            out.append(item)
        elif item.is_dir():
            try:
                out += sorted(f for f in item.rglob(glob) if f.is_file())
            except (ValueError, NotImplementedError) as e:  # a pattern pathlib refuses
                raise CorpusError(f"--glob {glob!r}: {e}") from None
        elif item.is_file():
            out.append(item)
        else:
            raise CorpusError(f"input {str(item)!r} does not exist")
    return out


def input_files(path: Path) -> list[Path]:
    """The files whose sizes and mtimes fingerprint an input (all files of a dataset directory)."""
    if path.is_dir():
        return sorted(f for f in path.rglob("*") if f.is_file())
    return [path]


def without_surrogates(text: str) -> str:
    """``text`` with each lone surrogate (valid in JSON and in Python, not in UTF-8) as U+FFFD, the way invalid UTF-8
    bytes become U+FFFD: a tokenizer given one raises (TypeError in Hugging Face's, UnicodeEncodeError in ours)."""
    return _SURROGATE.sub("\ufffd", text) if not text.isascii() and _SURROGATE.search(text) else text


def _lines(path: Path, fh: Any) -> Iterator[bytes]:
    """The lines of a binary file, each read with a bound (MAX_LINE_BYTES)."""
    lineno = 0
    while line := fh.readline(MAX_LINE_BYTES + 1):
        lineno += 1
        if len(line) > MAX_LINE_BYTES:
            raise CorpusError(
                f"{path}:{lineno}: a line longer than {MAX_LINE_BYTES >> 20} MiB (one document per "
                "line): split the document, or is this not a JSON-lines file?"
            )
        yield line


def _json_lines(path: Path, lines: Iterator[bytes], field: str) -> Iterator[tuple[str, int]]:
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise CorpusError(f"{path}:{lineno}: not a JSON line ({e})") from e
        except RecursionError:  # [[[[... nested deeper than the parser goes
            raise CorpusError(f"{path}:{lineno}: a JSON value nested too deeply to parse") from None
        if not isinstance(record, dict) or field not in record:
            keys = ", ".join(map(str, list(record)[:20])) if isinstance(record, dict) else type(record).__name__
            raise CorpusError(f"{path}:{lineno}: no field {field!r} (has: {keys}); choose one with --text-field")
        text = record[field]
        if not isinstance(text, str):
            raise CorpusError(f"{path}:{lineno}: field {field!r} is {type(text).__name__}, not text")
        yield without_surrogates(text), len(line)


def _parquet(path: Path, field: str, row_groups: Sequence[int] | None = None) -> Iterator[tuple[str, int]]:
    # optional dependency, imported only when a parquet file is read
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise CorpusError(f"{path}: reading parquet needs pyarrow: {EXTRA}") from e
    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names
    if field not in names:
        raise CorpusError(f"{path}: no column {field!r} (has: {', '.join(names)}); choose one with --text-field")
    for batch in pf.iter_batches(columns=[field], batch_size=1024, row_groups=row_groups):
        for text in batch.column(0).to_pylist():
            if text is not None:
                yield text, len(text.encode("utf-8"))


def _hf_dataset(path: Path, field: str) -> Iterator[tuple[str, int]]:
    # optional dependency, imported only when a datasets directory is read (it imports slowly)
    try:
        import datasets
    except ImportError as e:
        raise CorpusError(f"{path}: reading a Hugging Face datasets directory needs datasets: {EXTRA}") from e
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # the library reports a directory that only looks like one in many ways (KeyError, ...)
        raise CorpusError(
            f"{path}: not a readable datasets directory (save_to_disk) ({type(e).__name__}: {str(e)[:200]})"
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise CorpusError(f"{path}: a DatasetDict without a 'train' split (has: {', '.join(ds)}); save one split")
        ds = ds["train"]
    if field not in ds.column_names:
        raise CorpusError(
            f"{path}: no column {field!r} (has: {', '.join(ds.column_names)}); choose one with --text-field"
        )
    for batch in ds.select_columns([field]).iter(batch_size=1024):
        for text in batch[field]:
            if text is not None:
                yield text, len(text.encode("utf-8"))


def iter_documents(path: Path, *, text_field: str = "text") -> Iterator[tuple[str | bytes, int]]:
    """Every document of one input, in file order, with its size in input bytes."""
    kind = input_kind(path)
    if kind == "text":
        data = path.read_bytes()
        yield data, len(data)
    elif kind == "jsonl":
        with open(path, "rb") as fh:
            yield from _json_lines(path, _lines(path, fh), text_field)
    elif kind == "jsonl.gz":
        try:
            with gzip.open(path, "rb") as fh:
                yield from _json_lines(path, _lines(path, fh), text_field)
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:  # truncated or not gzip at all
            raise CorpusError(f"{path}: a damaged or truncated gzip file ({e}); compress it again") from None
    elif kind == "parquet":
        yield from _parquet(path, text_field)
    else:
        yield from _hf_dataset(path, text_field)
