"""The on-disk token shard format (docs/DATA.md) and the datasets that read it.

A prepared directory holds raw little-endian token files (``shard-00000.bin`` ...) and ``meta.json``, written last,
naming each shard and its token count, the dtype, the vocabulary and the tokenizer the data was prepared with.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from hpcdist.config.dataset_meta import DataError, DatasetMeta, check_shard_files, load_meta, open_shard
from hpcdist.config.loader import ConfigError

__all__ = [
    "SampleDataset",
    "SyntheticDataset",
    "TokenDataset",
    "read_shard_problems",
    "verify_shard",
]

log = logging.getLogger("hpcdist")

SHARD_PATTERN = "shard-{:05d}.bin"
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
# Up to this many shard bytes, a dataset's every shard is read and checked (sha256, largest id) when it is opened,
# before the first step: about 1.2 s per GiB here (sha256 ~850 MB/s, the max ~10 GB/s). Larger datasets check each
# shard the first time a process maps it (before any of its windows reaches the model).
EAGER_VERIFY_BYTES = 2**30
# Shards already checked by this process: (file identity, size, mtime, ctime): an edit changes ctime.
_VERIFIED: set[tuple[Any, ...]] = set()


def read_shard_problems(meta: DatasetMeta, k: int) -> list[str]:
    """Read shard ``k`` once (mapped: the read is bounded by the size meta.json gives) and say what is wrong with
    it: its size, its sha256 against the recorded one, its largest id against ``vocab_size`` and the recorded
    ``max_id`` (a shard from before checksums were recorded gets the size and id checks only). [] when it is
    intact; each problem is a phrase about the shard (the caller names it)."""
    s = meta.shards[k]
    fd = open_shard(meta.path, s.name)  # OSError: missing, a link, a FIFO, a directory
    try:
        st = os.fstat(fd)
        if st.st_size != s.tokens * meta.itemsize:
            return [
                f"holds {st.st_size:,} bytes, but meta.json says {s.tokens:,} {meta.dtype} tokens "
                f"({s.tokens * meta.itemsize:,} bytes): truncated, grown or replaced"
            ]
        with mmap.mmap(fd, st.st_size, access=mmap.ACCESS_READ) if st.st_size else _Empty() as mm:
            ids = np.frombuffer(mm, dtype=DTYPES[meta.dtype])
            top = int(ids.max()) if len(ids) else -1
            where = int(ids.argmax()) if top >= meta.vocab_size else -1
            digest = hashlib.sha256(mm).hexdigest() if s.sha256 is not None else None
            del ids  # the mmap cannot close while a view of it lives
    finally:
        os.close(fd)
    problems = []
    if top >= meta.vocab_size:
        problems.append(
            f"holds token id {top} (token {where:,}), past vocab_size={meta.vocab_size}: every id must be "
            "below it, or it indexes past the embedding table"
        )
    if digest is not None and digest != s.sha256:
        problems.append("its sha256 is not the one prepare recorded in meta.json: the file was changed after prepare")
    elif s.max_id is not None and top != s.max_id and not problems and s.tokens:
        problems.append(f"its largest id is {top}, but meta.json records {s.max_id}: the dtype or the file changed")
    return problems


def verify_shard(meta: DatasetMeta, k: int, *, key: str = "data.path") -> None:
    """Read shard ``k`` once: its sha256 must be the one prepare recorded, and every id below ``vocab_size`` (a
    shard from before checksums were recorded gets the id check only). DataError naming the shard otherwise."""
    s = meta.shards[k]
    file = meta.path / s.name
    try:
        fd = open_shard(meta.path, s.name)
    except OSError as e:
        raise DataError([f"{key} {file}: {e.strerror or e}"]) from None
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, meta.dtype, meta.vocab_size, s)
    if ident in _VERIFIED:
        return
    try:
        problems = read_shard_problems(meta, k)
    except OSError as e:
        raise DataError([f"{key} {file}: {e.strerror or e}"]) from None
    if problems:
        raise DataError(
            [
                f"{key} {file}: {'; '.join(problems)}; prepare the dataset again (hpcdist prepare ... "
                f"--overwrite --out {meta.path}) or restore the file"
            ]
        )
    _VERIFIED.add(ident)


class _Empty:
    """The buffer of an empty shard (mmap refuses length 0)."""

    def __enter__(self) -> bytes:
        return b""

    def __exit__(self, *exc: object) -> None:
        return None


class SampleDataset(Protocol):
    """What BatchLoader needs: a length and (seq_len + 1,) int64 samples by index."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> np.ndarray: ...


EOS_PROBE_TOKENS = 1 << 22  # what the document-mask check reads at most at start-up: 4M tokens, 16 MB at 4 B/id


def eos_count(ds: SampleDataset, eos: int, *, tokens: int = EOS_PROBE_TOKENS, stop_at: int = 1) -> int:
    """How often ``eos`` occurs in the first samples of ``ds`` (about ``tokens`` in all, a bounded read for start-up
    checks), counting until ``stop_at`` occurrences have been seen."""
    seen = read = 0
    for i in range(len(ds)):
        if seen >= stop_at or read >= tokens:
            break
        sample = ds[i]
        seen += int((sample == eos).sum())
        read += len(sample)
    return seen


def _check_index(i: int, n: int) -> int:
    if not -n <= i < n:
        raise IndexError(f"sample index {i} out of range for {n} samples")
    return i + n if i < 0 else i


class TokenDataset:
    """Read-only memory-mapped view of a prepared directory, as non-overlapping (seq_len + 1)-token windows.

    Windows never cross a shard boundary (each shard's tail shorter than a window is unused), so a sample is
    always one contiguous slice of one file. `split="val"` takes the last `val_fraction` of the samples.
    """

    def __init__(
        self, path: Path, seq_len: int, *, split: str = "train", val_fraction: float = 0.0, key: str = "data.path"
    ) -> None:
        self.path = Path(path)
        self._key = key  # how the user named the directory, for messages
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must lie in [0, 1), got {val_fraction}")
        if split == "val" and val_fraction == 0.0:
            raise ValueError("split='val' needs val_fraction > 0")
        meta = load_meta(self.path, key=key)  # a missing or damaged preparation: one line naming the fix
        check_shard_files(meta, key=key)
        self.seq_len = seq_len
        self.vocab_size: int = meta.vocab_size
        # what made the ids (meta.json's tokenizer; shards from before it was recorded are byte-level)
        self.tokenizer_kind: str = meta.tokenizer_kind
        self._meta = meta
        self._dtype = DTYPES[meta.dtype]
        window = seq_len + 1
        self._shard_names = [s.name for s in meta.shards]
        self._shard_tokens = [s.tokens for s in meta.shards]
        # starts[k] = global index of shard k's first window; starts[-1] = total windows.
        self._starts = np.cumsum([0] + [t // window for t in self._shard_tokens])
        total = int(self._starts[-1])
        n_val = max(1, round(total * val_fraction)) if val_fraction > 0 else 0
        n_train = total - n_val
        if n_train < 1:  # the user's data and data.seq_len / data.val_fraction do not fit together
            raise ConfigError(
                [
                    f"{self.path} holds {meta.num_tokens} tokens ({total} windows of seq_len + 1 = {window} within "
                    f"shards): too few for one train sample{' plus a val sample' if n_val else ''}; "
                    "prepare more tokens or lower data.seq_len"
                ]
            )
        if not meta.checksummed:
            log.warning(
                "data: %s was prepared before hpcdist recorded shard checksums: its token ids are checked "
                "against vocab_size, its contents cannot be verified; prepare it again to record them",
                self.path,
            )
        # Every shard is read once and checked before the first step (a bad id in a window the sampler has not drawn
        # yet must not wait for it), unless that costs more than EAGER_VERIFY_BYTES: then each shard when first mapped.
        self._eager = sum(self._shard_tokens) * self._dtype.itemsize <= EAGER_VERIFY_BYTES
        if self._eager:
            for k in range(len(meta.shards)):
                verify_shard(meta, k, key=key)
        self.split = split
        self._offset, self._len = (0, n_train) if split == "train" else (n_train, n_val)
        self._maps: dict[int, np.memmap] = {}

    def __len__(self) -> int:
        return self._len

    def _shard(self, k: int) -> np.ndarray:
        # Opened lazily: a rank maps only the shards it touches, and pickling (spawned workers) stays cheap.
        if k not in self._maps:
            verify_shard(self._meta, k, key=self._key)  # remembered when __init__ checked it, else the first read
            fd = open_shard(self.path, self._shard_names[k])  # never through a link, never a FIFO
            try:
                n = self._shard_tokens[k]
                buf = mmap.mmap(fd, n * self._dtype.itemsize, access=mmap.ACCESS_READ) if n else b""
            finally:
                os.close(fd)
            self._maps[k] = np.frombuffer(buf, dtype=self._dtype, count=n)
        return self._maps[k]

    def __getitem__(self, i: int) -> np.ndarray:
        g = self._offset + _check_index(int(i), self._len)
        k = int(np.searchsorted(self._starts, g, side="right")) - 1
        start = (g - int(self._starts[k])) * (self.seq_len + 1)
        window = self._shard(k)[start : start + self.seq_len + 1].astype(np.int64)
        # the shard was checked, but a file can change under a mapping: an id past the table never reaches the model
        if int(window.max()) >= self.vocab_size:
            raise DataError(
                [
                    f"{self.path / self._shard_names[k]}: token id {int(window.max())} at token "
                    f"{start + int(window.argmax()):,}, past vocab_size={self.vocab_size}: the shard changed "
                    "after it was checked; prepare the dataset again"
                ]
            )
        return window

    def where(self, i: int) -> str:
        """Where sample ``i`` lives on disk, for messages (the NaN triage names a bad sample's shard and offset)."""
        g = self._offset + _check_index(int(i), self._len)
        k = int(np.searchsorted(self._starts, g, side="right")) - 1
        return f"{self._shard_names[k]} token {(g - int(self._starts[k])) * (self.seq_len + 1):,}"

    def __getstate__(self) -> dict[str, Any]:
        # np.memmap would pickle as a full in-memory copy; reopen in the receiving process instead.
        return {**self.__dict__, "_maps": {}}


class SyntheticDataset:
    """Deterministic random tokens for benchmarks: sample i depends only on (seed, i), never on rank or layout."""

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int = 0) -> None:
        if num_samples < 1 or seq_len < 1 or vocab_size < 1:
            raise ValueError(
                f"num_samples, seq_len, vocab_size must be >= 1, got {num_samples}, {seq_len}, {vocab_size}"
            )
        self.num_samples = num_samples
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.seed = seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        i = _check_index(int(i), self.num_samples)
        rng = np.random.Generator(np.random.PCG64([self.seed, i]))
        return rng.integers(0, self.vocab_size, size=self.seq_len + 1, dtype=np.int64)
