"""``hpcdist`` command line: a thin layer over the library. Configuration errors print one message, no traceback."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpcdist.trainer import TrainResult

EPILOG = """examples:
  hpcdist train configs/demo.yaml                      # one process on this machine
  hpcdist train configs/demo.yaml train.steps=50 run.dir=runs/try
  torchrun --nproc_per_node=2 -m hpcdist.cli train configs/demo.yaml
  srun --ntasks-per-node=8 hpcdist train configs/train_13b.yaml   # one task per GPU
  hpcdist config configs/demo.yaml model.dim=512        # print the resolved, validated config
  hpcdist prepare ~/corpus --glob '*.txt' --out data/corpus
  hpcdist submit configs/train_13b.yaml --nodes 4 --partition gpu   # sbatch through submitit (8 ranks/node)
  hpcdist submit configs/demo.yaml --cluster local --wait          # no SLURM: ranks as local processes
  hpcdist submit configs/demo.yaml --cluster sandbox --dry-run     # print the sbatch script, submit nothing
  hpcdist status 1234; hpcdist logs 1234 --rank 3 --err; hpcdist cancel 1234
"""


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """argparse type: an integer >= minimum, with a message naming the rule."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)
_nonnegative_int = _int_at_least(0)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hpcdist",
        description="Train Llama-style language models (DDP or FSDP2) from one YAML config, locally or on SLURM.",
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
    _add_launch_parsers(sub)
    _add_plan_parser(sub)
    return p


def _add_launch_parsers(sub: argparse._SubParsersAction) -> None:
    """submit / status / logs / cancel: the SLURM side (hpcdist.launch)."""
    s = sub.add_parser(
        "submit",
        help="submit a training job to SLURM with submitit (local processes when no SLURM answers)",
        description="Validate CONFIG + overrides for the cluster's world size, then submit one job: one rank per "
        "GPU via srun, --requeue, a warning signal before the time limit (the trainer checkpoints and "
        "requeues), the cluster's NCCL profile. Cluster settings come from configs/cluster/NAME.yaml; the "
        "options below override them. Logs: <run.dir>/slurm/<jobid>_<rank>_log.out|err.",
    )
    s.add_argument("config", help="YAML training config, e.g. configs/train_13b.yaml")
    s.add_argument("overrides", nargs="*", metavar="section.key=value")
    s.add_argument("--cluster", default="a100_ib", help="name in configs/cluster/ or a YAML path (default: a100_ib)")
    s.add_argument("--nodes", type=_positive_int)
    s.add_argument("--gpus-per-node", type=_nonnegative_int, help="also the ranks per node")
    s.add_argument("--time", help="time limit: minutes, HH:MM:SS or D-HH:MM:SS")
    for name in ("partition", "account", "qos", "constraint"):
        s.add_argument(f"--{name}")
    s.add_argument("--exclude", metavar="NODELIST", help="nodes to avoid, e.g. gpu[012,040]")
    s.add_argument("--job-name", help="default: run.name")
    s.add_argument(
        "--sbatch-arg",
        action="append",
        default=[],
        dest="sbatch_args",
        metavar="--FLAG=VALUE",
        help="extra sbatch flag, written with '=': --sbatch-arg=--mail-type=END (repeatable)",
    )
    s.add_argument(
        "--dry-run", action="store_true", help="print the sbatch script that would be submitted; submit nothing"
    )
    s.add_argument(
        "--wait", action="store_true", help="wait for the job to finish (through requeues); exit 0 if COMPLETED"
    )

    st = sub.add_parser(
        "status", help="show a SLURM job (scontrol/sacct) or your queue (squeue)", description="Without JOB: squeue."
    )
    st.add_argument("job", nargs="?", help="job id")

    lg = sub.add_parser(
        "logs",
        help="print one rank's log of a submitted job",
        description="Print <log_dir>/<JOB>_<RANK>_log.out (or .err). The folder is taken from SLURM while it "
        "remembers the job, else from --run-dir (the run.dir, or the log_dir itself).",
    )
    lg.add_argument("job", help="job id")
    lg.add_argument("--rank", type=_nonnegative_int, default=0, help="global rank (default 0)")
    lg.add_argument("--err", action="store_true", help="stderr instead of stdout")
    lg.add_argument("--run-dir", type=Path, help="the job's run.dir (or log_dir)")

    ca = sub.add_parser("cancel", help="cancel a SLURM job (scancel)")
    ca.add_argument("job", help="job id")


def _gpu_mem(text: str) -> float:
    """``80GB`` / ``80GiB`` / ``80G`` / ``80`` -> 80.0 (GiB: an "A100-80GB" has 80 GiB)."""
    import re

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(?:G|GB|GiB)?\s*", text, re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a GPU memory size; give GiB like 80GB, 40GiB or 80")
    return float(m.group(1))


def _add_plan_parser(sub: argparse._SubParsersAction) -> None:
    pl = sub.add_parser(
        "plan",
        help="estimate per-GPU memory of each parallel strategy for a config",
        description="Print a table of per-GPU memory (params, grads, optimizer, activations, total) for ddp, "
        "zero1-3 (with CPU offload), fsdp and hsdp, for CONFIG's model, micro batch, seq_len and activation "
        "checkpointing on NODES x GPUS_PER_NODE GPUs, and whether each fits --gpu-mem.",
    )
    pl.add_argument("config", help="YAML training config, e.g. configs/train_13b.yaml")
    pl.add_argument("overrides", nargs="*", metavar="section.key=value")
    pl.add_argument("--nodes", type=_positive_int, default=1)
    pl.add_argument("--gpus-per-node", type=_positive_int, default=8)
    pl.add_argument("--gpu-mem", type=_gpu_mem, default=80.0, help="memory of one GPU, e.g. 80GB (default 80)")


def _fail(msg: str, code: int = 2) -> int:
    print(f"hpcdist: {msg}", file=sys.stderr)
    return code


def run_train(config_path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> TrainResult:
    """What ``hpcdist train`` runs in one process (rank); also the body of every task of ``hpcdist submit``."""
    from hpcdist import config as config_mod
    from hpcdist.env import destroy_process_group, from_environ, init_process_group
    from hpcdist.launch.nccl import PROFILE_ENV, apply_to_environ
    from hpcdist.logging_utils import log0, setup_logging

    cfg = config_mod.load(config_path, overrides)
    env = from_environ()
    config_mod.check_world(cfg, env.world_size)  # before any process group: a bad batch split fails fast
    config_mod.check_run_dir(cfg)  # every rank: one failing alone would leave the others at the rendezvous
    # In every task, before the process group: NCCL and gloo read these at init, and interface names differ
    # between hosts. A no-op unless the job names a profile (hpcdist submit exports HPCDIST_NCCL_PROFILE).
    nccl_lines = apply_to_environ(os.environ.get(PROFILE_ENV), master_addr=env.master_addr)
    if nccl_lines:
        setup_logging(env.rank, level=cfg.run.log_level)
        for line in nccl_lines:
            log0("%s", line)

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
    return result


def cmd_train(args: argparse.Namespace) -> int:
    return run_train(args.config, args.overrides).exit_code


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


def cmd_submit(args: argparse.Namespace) -> int:
    from hpcdist.launch import load_cluster, submit
    from hpcdist.launch.slurm_cli import SlurmError
    from hpcdist.launch.submit import LaunchError

    names = ("nodes", "gpus_per_node", "time", "partition", "account", "qos", "constraint", "exclude", "job_name")
    params = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    if args.sbatch_args:  # added to the cluster's own extra flags, not instead of them
        params["extra_sbatch"] = [*load_cluster(args.cluster).extra_sbatch, *args.sbatch_args]
    try:
        out = submit(args.config, args.overrides, cluster=args.cluster, dry_run=args.dry_run, **params)
        if isinstance(out, str):
            print(out, end="")
            return 0
        logs = out.paths[0]
        print(f"submitted job {out.job_id} ({out.executor}, {out.num_tasks} ranks)\n"
              f"  logs:   {logs.stdout}\n          {logs.stderr}\n"
              f"  follow: hpcdist status {out.job_id}; hpcdist logs {out.job_id} --rank R", flush=True)  # fmt: skip
        if not args.wait:
            return 0
        state = out.wait()
        print(f"job {out.job_id} finished: {state}")
        return 0 if state == "COMPLETED" else 1
    except (LaunchError, SlurmError) as e:
        return _fail(f"submit: {e}")
    except KeyboardInterrupt:
        return _fail("submit: stopped waiting; the job keeps running", code=130)


def cmd_status(args: argparse.Namespace) -> int:
    from hpcdist.launch import slurm_cli

    try:
        print(slurm_cli.status_text(args.job))
    except slurm_cli.SlurmError as e:
        return _fail(f"status: {e}")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    import shutil

    from hpcdist.launch import slurm_cli

    try:
        path = slurm_cli.log_path(args.job, rank=args.rank, err=args.err, run_dir=args.run_dir)
        with path.open(encoding="utf-8", errors="replace") as f:
            shutil.copyfileobj(f, sys.stdout)
    except slurm_cli.SlurmError as e:
        return _fail(f"logs: {e}")
    except OSError as e:
        return _fail(f"logs: cannot read {e.filename}: {e.strerror}")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    from hpcdist.launch import slurm_cli

    try:
        slurm_cli.cancel(args.job)
    except slurm_cli.SlurmError as e:
        return _fail(f"cancel: {e}")
    print(f"cancelled job {args.job}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from hpcdist import config as config_mod
    from hpcdist.plan import plan_table

    cfg = config_mod.load(args.config, args.overrides)
    print(
        plan_table(
            cfg.model_args(),
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            gpu_mem_gb=args.gpu_mem,
            micro_batch_size=cfg.train.micro_batch_size,
            seq_len=cfg.data.seq_len,
            activation_checkpointing=cfg.train.activation_checkpointing,
        ),
        end="",
    )
    return 0


COMMANDS = {
    "train": cmd_train,
    "config": cmd_config,
    "prepare": cmd_prepare,
    "submit": cmd_submit,
    "status": cmd_status,
    "logs": cmd_logs,
    "cancel": cmd_cancel,
    "plan": cmd_plan,
}


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
