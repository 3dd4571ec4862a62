"""The data commands of ``hpcdist``: ``prepare`` (text corpora or a Megatron-LM dataset -> token shards) and
``tokenizer train`` (a byte-level BPE). Bad input of any kind (a corpus, a tokenizer, the output directory) is one
line naming the command, printed by hpcdist.cli."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from hpcdist.base.errors import CommandError, refusing


def _inputs(items: Sequence[Path], globs: str) -> list[Path]:
    """The inputs in the order given; inside each directory, every file matching one of the patterns, sorted."""
    from hpcdist.data.corpora import expand_inputs

    patterns = [g.strip() for g in globs.split(",") if g.strip()]
    found: list[Path] = []
    for item in items:
        for path in sorted({p for g in patterns for p in expand_inputs([item], g)}):
            if path not in found:
                found.append(path)
    return found


def check_prepare_args(args: argparse.Namespace) -> None:
    """The options that only mean something with --cluster (hpcdist.launch.prepare_array) are refused without it."""
    cluster_only = [o for o, v in (("--tasks", args.tasks), ("--dry-run", args.dry_run), ("--after", args.after)) if v]
    if getattr(args, "cluster", None) is None and cluster_only:
        raise CommandError(f"prepare: {', '.join(cluster_only)} go with --cluster PROFILE (a SLURM job array)")


def prepare_inputs(args: argparse.Namespace) -> list[Path]:
    """prepare's inputs: --stdlib's files, then every input (directories searched with --glob). CommandError if
    there is none."""
    from hpcdist.data import stdlib_corpus

    files: list[Path] = [*(stdlib_corpus() if args.stdlib else []), *_inputs(args.inputs, args.glob)]
    if not files:
        raise CommandError("prepare: no input files (give files/directories, check --glob, or pass --stdlib)")
    return files


@refusing("prepare", ValueError, OSError)  # TokenizerError, CorpusError and PrepareRefused are ValueErrors
def cmd_prepare(args: argparse.Namespace) -> int:
    from hpcdist.data import load_tokenizer, prepare_corpus

    if args.megatron is not None:
        return _import_megatron(args)
    check_prepare_args(args)
    files = prepare_inputs(args)
    tok = load_tokenizer(args.tokenizer)
    res = prepare_corpus(
        files,
        args.out,
        tokenizer=tok,
        text_field=args.text_field,
        shard_tokens=args.shard_tokens,
        dtype=args.dtype,
        max_tokens=args.max_tokens,
        workers=args.workers,
        progress=sys.stderr,
        overwrite=args.overwrite,
    )
    if res.up_to_date:
        print(f"prepared {len(files)} files into {res.path}: already up to date ({res.num_tokens:,} tokens)")
        return 0
    kept = f", {res.kept_shards} shards kept from an interrupted run" if res.kept_shards else ""
    print(
        f"prepared {len(files)} files into {res.path}: {res.num_documents:,} documents, {res.num_tokens:,} tokens "
        f"(tokenizer {tok.kind}, vocab {tok.vocab_size:,}){kept}; {res.mb_per_s:.2f} MB/s, "
        f"{res.tokens_per_s:,.0f} tokens/s with {args.workers} workers"
    )
    return 0


def _import_megatron(args: argparse.Namespace) -> int:
    from hpcdist.data import load_tokenizer
    from hpcdist.data.megatron import import_megatron

    if args.inputs or args.stdlib:
        raise CommandError("prepare: --megatron imports PREFIX.bin/.idx; give no other inputs")
    tok = load_tokenizer(args.tokenizer)
    res = import_megatron(
        args.megatron,
        args.out,
        tokenizer=tok,
        shard_tokens=args.shard_tokens,
        dtype=args.dtype,
        overwrite=args.overwrite,
    )
    print(
        f"imported Megatron dataset {args.megatron} into {res.path}: {res.num_documents:,} documents, "
        f"{res.num_tokens:,} tokens (tokenizer {tok.kind}, vocab {tok.vocab_size:,})"
    )
    return 0


@refusing("tokenizer train", ValueError, OSError)  # CorpusError and TokenizerError are ValueErrors
def cmd_tokenizer(args: argparse.Namespace) -> int:
    from hpcdist.data import train_bpe

    inputs = _inputs(args.inputs, args.glob)
    if not inputs:
        raise CommandError("tokenizer train: no input files (check --glob)")
    tok = train_bpe(inputs, vocab_size=args.vocab_size, out_dir=args.out, text_field=args.text_field)
    print(
        f"trained a byte-level BPE of {tok.vocab_size:,} tokens on {len(inputs)} files into "
        f"{args.out / 'tokenizer.json'} (EOS {tok.eos_id}); "
        f"use it with: hpcdist prepare ... --tokenizer {args.out}"
    )
    return 0
