"""The dataset recipe: a config's ``data`` section (and ``train.eval_data``) -> the (train, val) datasets of a rank.

The trainer calls :func:`build_datasets` and knows nothing else about data: which source, where the stdlib corpus is
prepared, how a blend's sources are split and mixed, which dataset validation reads.

``data.source=stdlib`` is prepared by rank 0 alone (preparation is single-writer); the other ranks wait, then read
it. Rank 0's outcome is broadcast after the attempt, so a failed preparation (a refused ``data.path``, a full disk)
stops every rank with rank 0's reason at once, instead of leaving them in a barrier until the watchdog fires.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hpcdist.base.logging_utils import get_logger
from hpcdist.base.rundir import RunDir
from hpcdist.config import ConfigError, JobConfig
from hpcdist.config.dataset_meta import DataError
from hpcdist.config.vocab import data_eos
from hpcdist.data.blend import BlendedDataset
from hpcdist.data.corpora import stdlib_corpus
from hpcdist.data.prepare import prepare_shards
from hpcdist.data.shards import EOS_PROBE_TOKENS, SampleDataset, SyntheticDataset, TokenDataset, eos_count
from hpcdist.data.tokenizers import ByteTokenizer

__all__ = ["PreparationFailed", "build_datasets", "document_eos"]

log = get_logger(__name__)


class PreparationFailed(RuntimeError):
    """Rank 0 could not prepare the data for a reason that is not the config's (an I/O error): every rank raises it."""


def build_datasets(cfg: JobConfig, *, is_main: bool) -> tuple[Any, Any]:
    """(train, val) datasets of this rank; ``is_main``: this rank prepares what needs preparing (rank 0). With
    train.eval_data, val is that held-out dataset (all of it) instead of the val split."""
    train, val = _split_datasets(cfg, is_main)
    if cfg.train.eval_data:  # made with the training data's tokenizer: the start-up check (check_data) said so
        val = TokenDataset(Path(cfg.train.eval_data), cfg.data.seq_len)
        log.info("data: evaluating on %s (%d samples)", cfg.train.eval_data, len(val))
    return train, val


def _split_datasets(cfg: JobConfig, is_main: bool) -> tuple[Any, Any]:
    d = cfg.data
    if d.source == "synthetic":
        n_val = max(1, int(d.synthetic_samples * d.val_fraction)) if d.val_fraction else 0
        train = SyntheticDataset(d.synthetic_samples, d.seq_len, cfg.model.vocab_size, seed=cfg.run.seed)
        val = SyntheticDataset(n_val, d.seq_len, cfg.model.vocab_size, seed=cfg.run.seed + 1) if n_val else None
        return train, val
    if d.sources:  # a blend: each source split alike, mixed by the same weights
        weights = [s.weight for s in d.sources]

        def blend(split: str, seed: int, shuffle: bool) -> BlendedDataset:
            parts = [TokenDataset(Path(s.path), d.seq_len, split=split, val_fraction=d.val_fraction) for s in d.sources]
            return BlendedDataset(parts, weights, seed=seed, shuffle=shuffle)

        train = blend("train", cfg.run.seed, d.shuffle)
        log.info("data: blend of %d sources, %d train samples", len(d.sources), len(train))
        return train, (blend("val", cfg.run.seed + 1, False) if d.val_fraction else None)
    if d.source == "stdlib":
        path = Path(d.path) if d.path else RunDir(cfg.run.dir).data
        _on_rank0(is_main, lambda: _prepare_stdlib(cfg, path))
    else:
        path = Path(str(d.path))
    # the ids fit the embedding table: checked once, with this rank's other facts (hpcdist.rankfacts.rank_facts)
    train = TokenDataset(path, d.seq_len, split="train", val_fraction=d.val_fraction)
    val = TokenDataset(path, d.seq_len, split="val", val_fraction=d.val_fraction) if d.val_fraction else None
    log.info(
        "data: %s: %d train samples, %s tokenizer (vocab %d)", path, len(train), train.tokenizer_kind, train.vocab_size
    )
    return train, val


def _prepare_stdlib(cfg: JobConfig, path: Path) -> None:
    d = cfg.data
    t0 = time.perf_counter()
    # the run dir's own copy is replaced when data.dtype / max_tokens change; a user's data.path never is
    prepare_shards(
        stdlib_corpus(), path, dtype=d.dtype, max_tokens=d.max_tokens, tokenizer=ByteTokenizer(), overwrite=not d.path
    )
    log.info("data: stdlib corpus ready in %s (%.1fs)", path, time.perf_counter() - t0)


def _on_rank0(is_main: bool, prepare: Any) -> None:
    """Run ``prepare`` on rank 0; every rank then learns its outcome and raises alike when it failed (a refusal as
    the same one-line ConfigError, anything else as :class:`PreparationFailed` naming rank 0's error)."""
    error: BaseException | None = None
    if is_main:
        try:
            prepare()
        except Exception as e:  # agreed on below; rank 0 re-raises its own exception, with its traceback
            error = e
    if not dist.is_initialized():
        if error is not None:
            raise error
        return
    # (is a refusal, the message) from rank 0: one small object broadcast, the rendezvous the barrier was
    outcome: list[Any] = [None if error is None else (isinstance(error, ConfigError), str(error))]
    dist.broadcast_object_list(outcome, src=0)
    if error is not None:
        raise error
    if outcome[0] is not None:
        refusal, message = outcome[0]
        if refusal:
            raise DataError([message])
        raise PreparationFailed(f"rank 0 could not prepare the data: {message}")


def document_eos(cfg: JobConfig, train_ds: SampleDataset) -> int:
    """The id data.document_mask splits samples at; a warning when the first samples never hold it (a mask that
    splits nothing: the wrong eos_id in meta.json, or data prepared without document ends)."""
    eos, why = data_eos(cfg)
    if eos is None:  # check_data refused it already at start-up; a Trainer given other data meets it here
        raise ConfigError([f"data.document_mask: {why}: documents are found by their EOS; set it false"])
    log.info("data: document mask on: attention and RoPE positions restart after each EOS (id %d)", eos)
    if not eos_count(train_ds, eos):
        log.warning(
            "data.document_mask: the first %s tokens of the data never hold the EOS id %d, so each sample "
            "trains as one document; check the data's meta.json eos_id against its tokenizer",
            f"{EOS_PROBE_TOKENS:,}",
            eos,
        )
    return eos
