"""The one place where the model's vocabulary meets the data's: ``model.vocab_size: auto`` and the vocabulary check.

A token id >= model.vocab_size indexes past the embedding table: an IndexError mid-run on CPU, a device-side assert
on GPU. So the data's vocabulary (the byte tokenizer's 258 for data.source=stdlib; meta.json's ``vocab_size`` for
data.source=files, written by ``hpcdist prepare``) is compared before any process group exists.

``auto`` takes the data's vocabulary rounded up to a multiple of :data:`VOCAB_MULTIPLE` (64: the embedding and output
matmuls tile evenly on tensor cores, and a tp-sharded vocabulary splits evenly up to tp=64). The extra rows are
padding: no prepared token id reaches them, so they are never a training target and never sampled from the data.

Torch-free: meta.json is read by :mod:`hpcdist.config.dataset_meta` (hpcdist.data imports torch).
"""

from __future__ import annotations

import json

from hpcdist.byte_vocab import BYTE_EOS_ID, BYTE_VOCAB
from hpcdist.config.dataset_meta import DataError, DatasetMeta, check_shard_files, load_meta
from hpcdist.config.rules import MAXIMA
from hpcdist.config.schema import JobConfig

__all__ = [
    "VOCAB_MULTIPLE",
    "DataError",
    "check_data",
    "check_same_tokenizer",
    "data_eos",
    "data_tokenizer_identity",
    "data_vocab",
    "dataset_paths",
    "resolve_vocab",
]

VOCAB_MULTIPLE = 64


def _prepare_hint(path: str) -> str:
    return f"make it with `hpcdist prepare INPUT... --tokenizer SPEC --out {path}`"


def _meta(path: str, key: str) -> tuple[DatasetMeta | None, str]:
    """(the validated meta.json of ``path``, "") or (None, the one-line problem naming ``key``)."""
    try:
        return load_meta(path, key=key), ""
    except DataError as e:
        return None, e.problems[0]


def _dataset_meta(path: str) -> DatasetMeta | None:
    return _meta(path, "data.path")[0]


def _describe_tokenizer(key: dict, where: str) -> str:
    files = ", ".join(f"{name} sha256 {digest[:12]}" for name, digest in sorted(key["files"].items()))
    return f"the {key['kind']} tokenizer (vocab {key['vocab_size']}{'; ' + files if files else ''}) of {where}"


_BYTE_KEY = {"kind": "byte", "vocab_size": BYTE_VOCAB, "files": {}}


def data_tokenizer_identity(cfg: JobConfig) -> tuple[dict | None, str]:
    """(identity of the tokenizer the run's training data was made with, its description); identity None when the
    data has none (data.source=synthetic) or its dataset is missing."""
    d = cfg.data
    if d.source == "stdlib":
        return _BYTE_KEY, _describe_tokenizer(_BYTE_KEY, "data.source=stdlib")
    paths = dataset_paths(cfg)
    if not paths:
        return None, f"data.source={d.source} (random token ids, no tokenizer)"
    key, path = paths[0]
    meta = _dataset_meta(path)
    if meta is None:
        return None, f"{key}={path} (no prepared dataset there)"
    return meta.tokenizer_identity, _describe_tokenizer(meta.tokenizer_identity, f"{key}={path}")


def check_same_tokenizer(cfg: JobConfig, key: str, path: str) -> list[str]:
    """``path`` is a prepared dataset made with the run's tokenizer and its ids fit the model: else one problem,
    naming both tokenizers (the same ids would mean different text)."""
    found, problem = _meta(path, f"{key}:")
    if found is None:
        return [problem]
    theirs = found.tokenizer_identity
    mine, where = data_tokenizer_identity(cfg)
    if mine is not None and theirs != mine:
        return [
            f"{key}: {path} was prepared with {_describe_tokenizer(theirs, key)}, but the run trains on {where}: "
            "prepare it again with the run's tokenizer (prepare --tokenizer <the run's data dir>)"
        ]
    vocab = found.vocab_size
    if isinstance(cfg.model.vocab_size, int) and vocab > cfg.model.vocab_size:
        return [f"{key}: {path} holds ids up to {vocab - 1}, past model.vocab_size={cfg.model.vocab_size}"]
    return []


def dataset_paths(cfg: JobConfig) -> list[tuple[str, str]]:
    """(config key, directory) of every prepared dataset the config reads: data.path, or each of data.sources."""
    d = cfg.data
    if d.source != "files":
        return []
    if d.sources:
        return [(f"data.sources[{i}].path", s.path) for i, s in enumerate(d.sources)]
    return [("data.path", d.path)] if d.path else []


def data_vocab(cfg: JobConfig) -> tuple[int | None, str]:
    """(the data's vocabulary size or None when unknown, where it comes from: for messages). A blend's is the
    largest of its sources'."""
    d = cfg.data
    if d.source == "stdlib":
        return BYTE_VOCAB, "the byte tokenizer of data.source=stdlib"
    paths = dataset_paths(cfg)
    if not paths:
        return None, f"data.source={d.source}"
    found = []
    for key, path in paths:
        meta = _dataset_meta(path)
        if meta is None:
            return None, f"{key}={path}"
        found.append((meta.vocab_size, f"the {meta.tokenizer_kind} tokenizer of {key}={path}"))
    return max(found)


def data_eos(cfg: JobConfig) -> tuple[int | None, str]:
    """(the EOS id that ends the data's documents, or None with the reason): what ``data.document_mask`` splits
    packed samples at. stdlib: the byte tokenizer's; files: meta.json's ``eos_id`` (every source of a blend must
    record the same one); synthetic: none."""
    d = cfg.data
    if d.source == "stdlib":
        return BYTE_EOS_ID, ""
    paths = dataset_paths(cfg)
    if not paths:
        return None, f"data.source={d.source} has no documents (random ids, no EOS)"
    found: dict[str, int] = {}
    for key, path in paths:
        meta = _dataset_meta(path)
        if meta is None:
            return None, f"{key}={path} holds no prepared dataset"
        eos = meta.raw.get("eos_id")  # validated by load_meta: an int below vocab_size, or absent
        if eos is None:
            return None, f"{key}={path}: its meta.json records no eos_id (prepare it again with `hpcdist prepare`)"
        found[key] = int(eos)
    if len(set(found.values())) > 1:
        listed = ", ".join(f"{k} eos_id={v}" for k, v in found.items())
        return None, f"the sources end documents with different EOS ids ({listed})"
    return next(iter(found.values())), ""


def round_up(n: int, multiple: int = VOCAB_MULTIPLE) -> int:
    return -(-n // multiple) * multiple


def resolve_vocab(cfg: JobConfig) -> list[str]:
    """Turn ``model.vocab_size: auto`` into a number (in place); problems when it cannot be resolved.

    Called by config loading, so every later user (dry run, planner, trainer) sees an integer."""
    v = cfg.model.vocab_size
    if isinstance(v, str) and v.strip().isdigit():  # an override's text: model.vocab_size=32000
        most = MAXIMA["model.vocab_size"][0]
        if len(v.strip()) > len(str(most)):  # before int(): it refuses texts of thousands of digits with a ValueError
            return [f"model.vocab_size={v.strip()[:12]}... ({len(v.strip())} digits): must be at most {most}"]
        cfg.model.vocab_size = int(v)
        return []
    if v != "auto":
        return [] if isinstance(v, int) else [f"model.vocab_size: must be a positive integer or auto, got {v!r}"]
    vocab, where = data_vocab(cfg)
    if vocab is not None:
        cfg.model.vocab_size = round_up(vocab)
        return []
    if dataset_paths(cfg):
        path = where.split("=", 1)[1]
        return [
            f"model.vocab_size: auto reads the vocabulary of the prepared data, but {where} holds no prepared "
            f"dataset; {_prepare_hint(path)}, or give a number"
        ]
    return [f"model.vocab_size: auto needs prepared data to read the vocabulary from ({where}); give a number"]


def check_data(cfg: JobConfig, *, strict: bool = True) -> list[str]:
    """Start-up check, before any process group: the prepared data exists and its token ids fit the model.

    ``strict`` raises :class:`DataError` (one line); otherwise the problems are returned as warnings (the dry runs,
    which plan a job without its data)."""
    problems: list[str] = []
    m = cfg.model
    tokenizers = {}
    for key, path in dataset_paths(cfg):
        found, problem = _meta(path, key)
        if found is None:
            problems.append(problem)
            continue
        try:  # the files themselves, without reading them (start-up on every rank, and submit on the login node)
            check_shard_files(found, key=key)
        except DataError as e:
            problems.append(e.problems[0])
        else:
            tokenizers[path] = json.dumps(found.tokenizer_identity, sort_keys=True)
    if len(set(tokenizers.values())) > 1:
        problems.append(
            f"data.sources: prepared with different tokenizers ({', '.join(tokenizers)}): the same id "
            "would mean different text; prepare every source with one tokenizer"
        )
    vocab, where = data_vocab(cfg)
    if vocab is not None and isinstance(m.vocab_size, int) and vocab > m.vocab_size:
        problems.append(
            f"model.vocab_size={m.vocab_size} is smaller than the {vocab} tokens of {where}: ids up to {vocab - 1} "
            f"would index past the embedding table; set model.vocab_size: auto ({round_up(vocab)}) or >= {vocab}"
        )
    if cfg.train.eval_data:  # in-training validation on a held-out dataset: the same tokenizer as the training data
        problems += check_same_tokenizer(cfg, "train.eval_data", cfg.train.eval_data)
    if cfg.data.document_mask and cfg.data.source == "files" and not problems:  # synthetic: refused by the rules
        eos, why = data_eos(cfg)
        if eos is None:
            problems.append(f"data.document_mask: {why}: documents are found by their EOS; set it false")
    if problems and strict:
        raise DataError(problems)
    return problems
