"""Token data: tokenizers, corpora -> shards, datasets (and blends), the resumable sampler and the batch loader.

Pipeline::

    corpora (text, jsonl, parquet, datasets dirs) --prepare (tokenizer, worker processes)--> out_dir/shard-*.bin
          + meta.json (written last; names the tokenizer, copied into out_dir/tokenizer/)   [docs/DATA.md]
          --TokenDataset-----> sample i = (seq_len + 1,) int64 window (inputs + shifted targets)
          --BlendedDataset---> (data.sources) several datasets mixed by weight, each in its own epochs
          --ResumableSampler-> global sample order, one permutation per epoch
          --BatchLoader------> this data-parallel rank's slice of each global batch
          --PrefetchLoader---> the next batches built in a background thread (pinned on CUDA)

The sampler counts *global* samples, never per-rank ones, so a checkpoint taken with dp=2 resumes on dp=4
(or dp=1) reading exactly the samples an uninterrupted run would have read.

Preparation is single-writer: rank 0 prepares and the other ranks wait for its outcome before they open a
`TokenDataset` (:func:`hpcdist.data.build.build_datasets`, the dataset recipe the trainer calls; a failed preparation
stops every rank with rank 0's reason). Concurrent calls on one shared directory are not supported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpcdist.data.blend import BlendedDataset, BlendSampler, make_sampler
    from hpcdist.data.corpora import stdlib_corpus
    from hpcdist.data.loader import BatchLoader, PrefetchLoader
    from hpcdist.data.prepare import PrepareResult, prepare_corpus, prepare_shards
    from hpcdist.data.sampler import ResumableSampler
    from hpcdist.data.shards import SampleDataset, SyntheticDataset, TokenDataset
    from hpcdist.data.tokenizers import ByteTokenizer, Tokenizer, TokenizerError, load_tokenizer, train_bpe

# Where each public name lives, imported on first use (as in hpcdist.diagnostics): most of these modules import torch,
# and a torch-free submodule imported through this package (hpcdist.data.array, read by `hpcdist status`; prepare and
# check) must not pay for it.
_LAZY = {
    "BlendedDataset": "blend",
    "BlendSampler": "blend",
    "make_sampler": "blend",
    "stdlib_corpus": "corpora",
    "BatchLoader": "loader",
    "PrefetchLoader": "loader",
    "PrepareResult": "prepare",
    "prepare_corpus": "prepare",
    "prepare_shards": "prepare",
    "ResumableSampler": "sampler",
    "SampleDataset": "shards",
    "SyntheticDataset": "shards",
    "TokenDataset": "shards",
    "ByteTokenizer": "tokenizers",
    "Tokenizer": "tokenizers",
    "TokenizerError": "tokenizers",
    "load_tokenizer": "tokenizers",
    "train_bpe": "tokenizers",
}

__all__ = [
    "BatchLoader",
    "BlendSampler",
    "BlendedDataset",
    "ByteTokenizer",
    "PrefetchLoader",
    "PrepareResult",
    "ResumableSampler",
    "SampleDataset",
    "SyntheticDataset",
    "TokenDataset",
    "Tokenizer",
    "TokenizerError",
    "load_tokenizer",
    "make_sampler",
    "prepare_corpus",
    "prepare_shards",
    "stdlib_corpus",
    "train_bpe",
]


def __getattr__(name: str) -> Any:
    home = _LAZY.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"hpcdist.data.{home}"), name)
