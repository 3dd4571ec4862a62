"""``hpcdist`` command line: a thin layer over the library. Configuration errors print one message, no traceback."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

EPILOG = """examples:
  hpcdist train configs/demo.yaml                      # one process on this machine
  hpcdist train configs/demo.yaml train.steps=50 run.dir=runs/try
  torchrun --nproc_per_node=2 -m hpcdist.cli train configs/demo.yaml
  srun --ntasks-per-node=8 hpcdist train configs/train_13b.yaml   # one task per GPU
  hpcdist config configs/demo.yaml model.dim=512        # print the resolved, validated config
  hpcdist prepare ~/corpus --glob '*.txt' --out data/corpus
"""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hpcdist",
        description="Train Llama-style language models with DDP from one YAML config, on a laptop or a SLURM cluster.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    t = sub.add_parser(
        "train",
        help="train from a config (one process, or one per rank under torchrun/srun)",
        description="Train from CONFIG with section.key=value overrides (CLI > YAML > preset > defaults). "
        "The rank layout is read from torchrun or SLURM (srun) variables, else one process. "
        "With checkpoint.resume=auto (the default) a rerun continues from the newest complete checkpoint.",
    )
    t.add_argument("config", help="YAML config, e.g. configs/demo.yaml")
    t.add_argument("overrides", nargs="*", metavar="section.key=value", help="e.g. train.steps=200 run.dir=runs/x")

    c = sub.add_parser(
        "config",
        help="validate a config and print it fully resolved",
        description="Load CONFIG plus overrides, validate every key, and print the resolved YAML the trainer uses.",
    )
    c.add_argument("config")
    c.add_argument("overrides", nargs="*", metavar="section.key=value")
    c.add_argument(
        "--world-size", type=_positive_int, default=1, help="also check batch divisibility for this many ranks"
    )

    pr = sub.add_parser(
        "prepare",
        help="tokenize text files into memory-mapped token shards",
        description="Tokenize files (byte-level, nothing downloaded) into OUT/shard-*.bin + meta.json, usable with "
        "data.source=files data.path=OUT. Directories are searched recursively with --glob.",
    )
    pr.add_argument("inputs", nargs="*", type=Path, help="files or directories (omit with --stdlib)")
    pr.add_argument("--out", type=Path, required=True, help="output directory")
    pr.add_argument("--glob", default="*.txt", help="pattern for files inside directories (default: *.txt)")
    pr.add_argument(
        "--stdlib", action="store_true", help="use this Python's standard library sources (the default corpus)"
    )
    pr.add_argument("--dtype", choices=("uint16", "uint32"), default="uint16")
    pr.add_argument("--shard-tokens", type=_positive_int, default=2**24, help="tokens per shard file")
    pr.add_argument("--max-tokens", type=_positive_int, default=None, help="stop after this many tokens")
    return p


def _fail(msg: str, code: int = 2) -> int:
    print(f"hpcdist: {msg}", file=sys.stderr)
    return code


def cmd_train(args: argparse.Namespace) -> int:
    from hpcdist import config as config_mod
    from hpcdist.env import destroy_process_group, from_environ, init_process_group

    cfg = config_mod.load(args.config, args.overrides)
    env = from_environ()
    config_mod.check_world(cfg, env.world_size)  # before any process group: a bad batch split fails fast

    from hpcdist.trainer import run

    init_process_group(env)
    try:
        result = run(cfg, env)
    finally:
        destroy_process_group()
    if env.is_main and result.losses:
        first, last = min(result.losses), max(result.losses)
        print(f"done: step {result.step}, loss {result.losses[first]:.4f} (step {first}) -> "
              f"{result.losses[last]:.4f} (step {last}); run dir {cfg.run.dir}")  # fmt: skip
    return result.exit_code


def cmd_config(args: argparse.Namespace) -> int:
    from hpcdist import config as config_mod

    cfg = config_mod.load(args.config, args.overrides)
    config_mod.check_world(cfg, args.world_size)
    print(config_mod.dump(cfg), end="")
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from hpcdist.data import prepare_shards, stdlib_corpus

    files: list[Path] = stdlib_corpus() if args.stdlib else []
    for item in args.inputs:
        if item.is_dir():
            files += sorted(f for f in item.rglob(args.glob) if f.is_file())
        elif item.is_file():
            files.append(item)
        else:
            return _fail(f"prepare: input {str(item)!r} does not exist")
    if not files:
        return _fail("prepare: no input files (give files/directories, check --glob, or pass --stdlib)")
    try:
        out = prepare_shards(
            files, args.out, shard_tokens=args.shard_tokens, dtype=args.dtype, max_tokens=args.max_tokens
        )
    except (ValueError, OSError) as e:
        return _fail(f"prepare: {e}")
    print(f"prepared {len(files)} files into {out}")
    return 0


COMMANDS = {"train": cmd_train, "config": cmd_config, "prepare": cmd_prepare}


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    # overrides may follow options (`config X --world-size 2 train.steps=7`): argparse's nargs="*" positional
    # is consumed before the option, so collect the leftovers and accept those that look like key=value
    args, extra = parser.parse_known_args(argv)
    stray = [x for x in extra if x.startswith("-") or "=" not in x or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    from hpcdist.config import ConfigError

    try:
        return COMMANDS[args.command](args)
    except ConfigError as e:
        return _fail(str(e))


if __name__ == "__main__":
    sys.exit(main())
