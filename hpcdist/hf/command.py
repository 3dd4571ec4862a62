"""``hpcdist export`` (a checkpoint -> a Hugging Face Llama directory) and ``hpcdist import`` (the reverse, as a
step-0 checkpoint). Bad input (ConversionError, HFConfigError, TokenizerError, ConfigError are ValueErrors; an
unreadable or unwritable path an OSError) is one line naming the command, printed by hpcdist.cli."""

from __future__ import annotations

import argparse

from hpcdist.base.errors import refusing


@refusing("export", ValueError, OSError)
def cmd_export(args: argparse.Namespace) -> int:
    from hpcdist.hf.export import export, parse_shard_size

    max_shard = parse_shard_size(args.max_shard_size) if args.max_shard_size else None
    res = export(
        args.checkpoint,
        args.out,
        dtype=args.dtype,
        max_shard_size=max_shard,
        tokenizer=args.tokenizer,
        with_tokenizer=not args.no_tokenizer,
    )
    shards = sum(f.endswith(".safetensors") for f in res.files)
    print(
        f"exported {res.checkpoint} to {res.out}: {res.total_bytes / 1e6:,.1f} MB of {args.dtype} weights in "
        f"{shards} file(s), {', '.join(res.files)} ({res.seconds:.1f} s)"
    )
    return 0


@refusing("import", ValueError, OSError)
def cmd_import(args: argparse.Namespace) -> int:
    from hpcdist.hf.import_ import import_checkpoint

    path = import_checkpoint(args.hf_dir, args.out)
    print(f"imported {args.hf_dir} as {path} (weights only: the optimizer starts fresh)")
    return 0
