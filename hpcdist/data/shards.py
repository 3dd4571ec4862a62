"""The on-disk token shard format (docs/DATA.md) and the datasets that read it.

A prepared directory holds raw little-endian token files (``shard-00000.bin`` ...) and ``meta.json``, written last,
naming each shard and its token count, the dtype, the vocabulary and the tokenizer the data was prepared with.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from hpcdist.config.loader import ConfigError

__all__ = ["META_NAME", "SampleDataset", "SyntheticDataset", "TokenDataset", "read_meta"]

META_NAME = "meta.json"
SHARD_PATTERN = "shard-{:05d}.bin"
# Bumped whenever the on-disk layout changes, so an old directory is re-prepared rather than misread.
FORMAT_VERSION = 1
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def read_meta(path: Path) -> dict[str, Any] | None:
    try:
        with open(path / META_NAME, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):  # missing, unreadable, or a torn/garbled file: not a dataset
        return None


def is_complete(path: Path, meta: Mapping[str, Any]) -> bool:
    """meta.json is written last, but also check every shard it names is present with the right size."""
    try:
        itemsize = DTYPES[meta["dtype"]].itemsize
        return all(os.path.getsize(path / s["name"]) == s["tokens"] * itemsize for s in meta["shards"])
    except (KeyError, TypeError, OSError):
        return False


class SampleDataset(Protocol):
    """What BatchLoader needs: a length and (seq_len + 1,) int64 samples by index."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> np.ndarray: ...


def _check_index(i: int, n: int) -> int:
    if not -n <= i < n:
        raise IndexError(f"sample index {i} out of range for {n} samples")
    return i + n if i < 0 else i


class TokenDataset:
    """Read-only memory-mapped view of a prepared directory, as non-overlapping (seq_len + 1)-token windows.

    Windows never cross a shard boundary (each shard's tail shorter than a window is unused), so a sample is
    always one contiguous slice of one file. `split="val"` takes the last `val_fraction` of the samples.
    """

    def __init__(self, path: Path, seq_len: int, *, split: str = "train", val_fraction: float = 0.0) -> None:
        self.path = Path(path)
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must lie in [0, 1), got {val_fraction}")
        if split == "val" and val_fraction == 0.0:
            raise ValueError("split='val' needs val_fraction > 0")
        meta = read_meta(self.path)
        if meta is None or not is_complete(self.path, meta):  # the user's data.path (or a damaged preparation)
            raise ConfigError([
                f"data.path: no complete prepared dataset at {self.path} (missing or incomplete {META_NAME}); "
                "run `hpcdist prepare` first"
            ])  # fmt: skip
        self.seq_len = seq_len
        self.vocab_size: int = int(meta["vocab_size"])
        # what made the ids (meta.json's tokenizer; shards from before it was recorded are byte-level)
        self.tokenizer_kind: str = (meta.get("tokenizer") or {}).get("kind", "byte")
        self._dtype = DTYPES[meta["dtype"]]
        window = seq_len + 1
        self._shard_names = [s["name"] for s in meta["shards"]]
        self._shard_tokens = [int(s["tokens"]) for s in meta["shards"]]
        # starts[k] = global index of shard k's first window; starts[-1] = total windows.
        self._starts = np.cumsum([0] + [t // window for t in self._shard_tokens])
        total = int(self._starts[-1])
        n_val = max(1, round(total * val_fraction)) if val_fraction > 0 else 0
        n_train = total - n_val
        if n_train < 1:  # the user's data and data.seq_len / data.val_fraction do not fit together
            raise ConfigError([
                f"{self.path} holds {meta['num_tokens']} tokens ({total} windows of seq_len + 1 = {window} within "
                f"shards): too few for one train sample{' plus a val sample' if n_val else ''}; "
                "prepare more tokens or lower data.seq_len"
            ])  # fmt: skip
        self.split = split
        self._offset, self._len = (0, n_train) if split == "train" else (n_train, n_val)
        self._maps: dict[int, np.memmap] = {}

    def __len__(self) -> int:
        return self._len

    def _shard(self, k: int) -> np.ndarray:
        # Opened lazily: a rank maps only the shards it touches, and pickling (spawned workers) stays cheap.
        if k not in self._maps:
            self._maps[k] = np.memmap(
                self.path / self._shard_names[k], dtype=self._dtype, mode="r", shape=(self._shard_tokens[k],)
            )
        return self._maps[k]

    def __getitem__(self, i: int) -> np.ndarray:
        g = self._offset + _check_index(int(i), self._len)
        k = int(np.searchsorted(self._starts, g, side="right")) - 1
        start = (g - int(self._starts[k])) * (self.seq_len + 1)
        return self._shard(k)[start : start + self.seq_len + 1].astype(np.int64)

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
