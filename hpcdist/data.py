"""Token data: byte tokenizer, memory-mapped token shards, and a resumable, layout-independent sampler.

Pipeline::

    files --prepare_shards--> out_dir/shard-00000.bin ... + meta.json (written last)
          --TokenDataset-----> sample i = (seq_len + 1,) int64 window (inputs + shifted targets)
          --ResumableSampler-> global sample order, one permutation per epoch
          --BatchLoader------> this data-parallel rank's slice of each global batch

The sampler counts *global* samples, never per-rank ones, so a checkpoint taken with dp=2 resumes on dp=4
(or dp=1) reading exactly the samples an uninterrupted run would have read.

Preparation is single-writer: rank 0 calls `prepare_shards` and the other ranks wait on a barrier before they
open a `TokenDataset` (the trainer does this). Concurrent calls on one shared directory are not supported.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from hpcdist.atomic import atomic_write
from hpcdist.config.loader import ConfigError

__all__ = [
    "BatchLoader",
    "ByteTokenizer",
    "ResumableSampler",
    "SyntheticDataset",
    "TokenDataset",
    "prepare_shards",
    "stdlib_corpus",
]

META_NAME = "meta.json"
SHARD_PATTERN = "shard-{:05d}.bin"
# Bumped whenever the on-disk layout changes, so an old directory is re-prepared rather than misread.
FORMAT_VERSION = 1
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus BOS (256) and EOS (257). No training, no files, any input."""

    vocab_size = 258
    bos_id = 256
    eos_id = 257

    def encode(self, text: str | bytes, *, bos: bool = False, eos: bool = True) -> np.ndarray:
        """Token ids (uint16) of the UTF-8 bytes of `text`, optionally framed by BOS / EOS."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        ids = np.empty(len(data) + int(bos) + int(eos), dtype=np.uint16)
        start = int(bos)
        ids[start : start + len(data)] = np.frombuffer(data, dtype=np.uint8)
        if bos:
            ids[0] = self.bos_id
        if eos:
            ids[-1] = self.eos_id
        return ids

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of `ids`; BOS/EOS are dropped and invalid UTF-8 (e.g. a cut multi-byte char) becomes U+FFFD."""
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}), got min {arr.min()} max {arr.max()}")
        return arr[arr < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")


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


def _fingerprint(
    files: Sequence[Path], *, dtype: str, max_tokens: int | None, shard_tokens: int, vocab_size: int
) -> str:
    """Hash of what determines the output: input paths, sizes, mtimes, and the preparation options."""
    h = hashlib.sha256()
    header = {
        "format": FORMAT_VERSION,
        "dtype": dtype,
        "max_tokens": max_tokens,
        "shard_tokens": shard_tokens,
        "vocab_size": vocab_size,
    }
    h.update(json.dumps(header, sort_keys=True).encode())
    for f in files:
        st = os.stat(f)
        h.update(f"\0{os.fspath(f)}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()


def _read_meta(path: Path) -> dict[str, Any] | None:
    try:
        with open(path / META_NAME, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):  # missing, unreadable, or a torn/garbled file: not a dataset
        return None


def _is_complete(path: Path, meta: Mapping[str, Any]) -> bool:
    """meta.json is written last, but also check every shard it names is present with the right size."""
    try:
        itemsize = _DTYPES[meta["dtype"]].itemsize
        return all(os.path.getsize(path / s["name"]) == s["tokens"] * itemsize for s in meta["shards"])
    except (KeyError, TypeError, OSError):
        return False


def prepare_shards(
    files: Sequence[Path],
    out_dir: Path,
    *,
    shard_tokens: int = 2**24,
    dtype: str = "uint16",
    max_tokens: int | None = None,
    tokenizer: ByteTokenizer | None = None,
) -> Path:
    """Tokenize `files` (EOS after each) into raw little-endian shards of `shard_tokens` tokens plus meta.json.

    Idempotent: returns at once if out_dir already holds a complete dataset with the same fingerprint (paths,
    sizes, mtimes, options). meta.json is written last and every file goes through temp-name + rename, so an
    interrupted run never leaves a directory that looks complete. Files are read as bytes: any encoding works.
    `max_tokens` caps the total (the last document is cut). Single writer: rank 0 prepares, others wait.
    """
    tok = tokenizer if tokenizer is not None else ByteTokenizer()
    files = [Path(f) for f in files]
    out_dir = Path(out_dir)
    problems = []
    if dtype not in _DTYPES:
        problems.append(f"dtype={dtype!r} is not supported; use one of {sorted(_DTYPES)}")
    elif tok.vocab_size > np.iinfo(_DTYPES[dtype]).max + 1:
        problems.append(f"dtype={dtype} cannot hold vocab_size={tok.vocab_size}; use uint32")
    if shard_tokens < 1:
        problems.append(f"shard_tokens must be >= 1, got {shard_tokens}")
    if max_tokens is not None and max_tokens < 1:
        problems.append(f"max_tokens must be >= 1 or None, got {max_tokens}")
    if not files:
        problems.append("no input files given")
    if problems:
        raise ValueError("prepare_shards: " + "; ".join(problems))

    fingerprint = _fingerprint(
        files, dtype=dtype, max_tokens=max_tokens, shard_tokens=shard_tokens, vocab_size=tok.vocab_size
    )
    meta = _read_meta(out_dir)
    if meta is not None and meta.get("fingerprint") == fingerprint and _is_complete(out_dir, meta):
        return out_dir

    out_dir.mkdir(parents=True, exist_ok=True)
    # Remove the old meta.json FIRST: from here on the directory must not look complete until we finish.
    (out_dir / META_NAME).unlink(missing_ok=True)
    for stale in [*out_dir.glob("shard-*.bin*"), *out_dir.glob(f"{META_NAME}.tmp.*")]:
        stale.unlink()

    np_dtype = _DTYPES[dtype]
    buf = np.empty(shard_tokens, dtype=np_dtype)
    fill = 0
    shards: list[dict[str, Any]] = []
    total = 0
    num_docs = 0

    def flush() -> None:
        nonlocal fill
        name = SHARD_PATTERN.format(len(shards))
        atomic_write(out_dir / name, memoryview(buf[:fill]).cast("B"))
        shards.append({"name": name, "tokens": fill})
        fill = 0

    for f in files:
        if max_tokens is not None and total >= max_tokens:
            break
        ids = tok.encode(f.read_bytes(), eos=True)
        if max_tokens is not None:
            ids = ids[: max_tokens - total]
        num_docs += 1
        total += len(ids)
        # A document may straddle two shards; the token stream itself stays continuous.
        pos = 0
        while pos < len(ids):
            take = min(len(ids) - pos, shard_tokens - fill)
            buf[fill : fill + take] = ids[pos : pos + take]
            fill += take
            pos += take
            if fill == shard_tokens:
                flush()
    if fill:
        flush()

    meta = {
        "format": FORMAT_VERSION,
        "dtype": dtype,
        "vocab_size": tok.vocab_size,
        "bos_id": tok.bos_id,
        "eos_id": tok.eos_id,
        "shard_tokens": shard_tokens,
        "max_tokens": max_tokens,
        "num_tokens": total,
        "num_documents": num_docs,
        "shards": shards,
        "fingerprint": fingerprint,
    }
    atomic_write(out_dir / META_NAME, (json.dumps(meta, indent=2) + "\n").encode())
    return out_dir


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
        meta = _read_meta(self.path)
        if meta is None or not _is_complete(self.path, meta):  # the user's data.path (or a damaged preparation)
            raise ConfigError([
                f"data.path: no complete prepared dataset at {self.path} (missing or incomplete {META_NAME}); "
                "run `hpcdist prepare` first"
            ])  # fmt: skip
        self.seq_len = seq_len
        self.vocab_size: int = int(meta["vocab_size"])
        self._dtype = _DTYPES[meta["dtype"]]
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


class ResumableSampler:
    """Global sample order: per epoch a permutation from torch.Generator(seed + epoch), or identity.

    `position` counts global samples consumed in the current epoch, independent of how many data-parallel ranks
    split them, so state saved at one dp size resumes exactly at another.
    """

    def __init__(self, num_samples: int, *, seed: int = 0, shuffle: bool = True) -> None:
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order: torch.Tensor | None = None
        self._order_epoch = -1

    def _epoch_order(self) -> torch.Tensor:
        if self._order_epoch != self.epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + self.epoch)
                self._order = torch.randperm(self.num_samples, generator=g)
            else:
                self._order = torch.arange(self.num_samples)
            self._order_epoch = self.epoch
        assert self._order is not None
        return self._order

    def next_indices(self, n: int) -> list[int]:
        """The next `n` global sample ids; crosses into the next epoch (new permutation) when needed."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        out: list[int] = []
        while len(out) < n:
            take = min(n - len(out), self.num_samples - self.position)
            out.extend(self._epoch_order()[self.position : self.position + take].tolist())
            self.position += take
            # Roll over eagerly so a saved state is canonical: (epoch + 1, 0), never (epoch, num_samples).
            if self.position == self.num_samples:
                self.epoch += 1
                self.position = 0
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_samples": self.num_samples}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Resume from `state_dict()`; refuses a state saved for another dataset size or seed."""
        missing = {"epoch", "position", "seed", "num_samples"} - set(state)
        if missing:
            raise ValueError(f"sampler state lacks {sorted(missing)}")
        if int(state["num_samples"]) != self.num_samples:
            raise ValueError(
                f"sampler state is for {state['num_samples']} samples but the dataset has {self.num_samples}: "
                "the data (or seq_len / val_fraction) changed since the checkpoint"
            )
        if int(state["seed"]) != self.seed:
            raise ValueError(f"sampler state has seed {state['seed']} but this run uses seed {self.seed}")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.num_samples:
            raise ValueError(f"bad sampler state: epoch={epoch}, position={position}, num_samples={self.num_samples}")
        self.epoch, self.position = (epoch + 1, 0) if position == self.num_samples else (epoch, position)


class BatchLoader:
    """This data-parallel rank's contiguous slice of each global batch drawn from a ResumableSampler.

    Every rank draws the whole global batch from its own sampler copy (cheap: ids only) and loads only its
    slice, so all ranks stay in lock step without communication and the state is the same on every rank.
    """

    def __init__(
        self,
        dataset: SampleDataset,
        sampler: ResumableSampler,
        *,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
    ) -> None:
        problems = []
        if dp_size < 1:
            problems.append(f"dp_size must be >= 1, got {dp_size}")
        elif not 0 <= dp_rank < dp_size:
            problems.append(f"dp_rank must lie in [0, {dp_size}), got {dp_rank}")
        if global_batch_size < 1:
            problems.append(f"global_batch_size must be >= 1, got {global_batch_size}")
        elif dp_size >= 1 and global_batch_size % dp_size:
            problems.append(
                f"global_batch_size={global_batch_size} is not divisible by dp_size={dp_size}; "
                "pick a multiple of the data-parallel size"
            )
        if sampler.num_samples != len(dataset):
            problems.append(f"sampler covers {sampler.num_samples} samples but the dataset has {len(dataset)}")
        if problems:
            raise ValueError("BatchLoader: " + "; ".join(problems))
        self.dataset = dataset
        self.sampler = sampler
        self.global_batch_size = global_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.local_batch_size = global_batch_size // dp_size
        self._last: list[int] = []

    def next_batch(self) -> torch.Tensor:
        """(global_batch_size // dp_size, seq_len + 1) int64 CPU tensor for this rank."""
        ids = self.sampler.next_indices(self.global_batch_size)
        lo = self.dp_rank * self.local_batch_size
        self._last = ids[lo : lo + self.local_batch_size]
        return torch.from_numpy(np.stack([self.dataset[i] for i in self._last]))

    def last_indices(self) -> list[int]:
        """Global sample ids of this rank's most recent batch."""
        return list(self._last)

    def state_dict(self) -> dict[str, int]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.sampler.load_state_dict(state)
