"""``hpcdist`` command line: argparse and dispatch only. Each command's body lives beside its library
(COMMANDS names it as ``module:function``, imported only when that command runs: ``--help`` loads no torch) and
returns the exit status; a refusal is a ``hpcdist.base.errors.CommandError``. ``main`` is the one error wrapper: a
refusal or a configuration error prints one line, no traceback (exit 2 unless the command says otherwise); Ctrl-C
prints one line (exit 130); anything unforeseen prints one line naming the error and the file that holds its
traceback (exit 1)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hpcdist.base import signals

DEFAULT_GLOB = "*.txt,*.jsonl,*.jsonl.gz,*.parquet"  # prepare / tokenizer train: files inside directories

EPILOG = """examples:
  hpcdist train configs/demo.yaml                      # one process on this machine
  hpcdist train configs/demo.yaml train.steps=50 run.dir=runs/try
  hpcdist train configs/train_13b.yaml --dry-run --world-size 32   # check the 32-GPU layout here, no GPU
  torchrun --nproc_per_node=2 -m hpcdist train configs/demo.yaml
  srun --ntasks-per-node=8 hpcdist train configs/train_13b.yaml   # one task per GPU
  hpcdist config configs/demo.yaml model.dim=512        # print the resolved, validated config
  hpcdist data tokenizer ~/corpus --vocab-size 32000 --out data/tok   # byte-level BPE from local text
  hpcdist data prepare ~/corpus --tokenizer data/tok --out data/corpus  # txt / jsonl / parquet -> token shards
  hpcdist data check data/corpus --full                                # every shard against its meta.json
  hpcdist submit configs/train_13b.yaml --nodes 4 --partition gpu   # sbatch through submitit (8 ranks/node)
  hpcdist plan configs/train_13b.yaml --nodes 4 --gpus-per-node 8  # memory per strategy + ranked layouts
  hpcdist submit configs/demo.yaml --cluster local --wait          # no SLURM: ranks as local processes
  hpcdist nccl-check --nproc 4                                     # the communication check (tools/nccl_check)
  hpcdist submit configs/demo.yaml --cluster sandbox --dry-run     # print the sbatch script, submit nothing
  hpcdist submit configs/demo.yaml --sweep optim.lr=1e-4,3e-4 --sweep train.global_batch_size=256,512  # 1 array
  hpcdist submit configs/demo.yaml --chain 3                         # 3 jobs, each resuming the previous one
  hpcdist status 1234; hpcdist logs 1234 --rank 3 --err; hpcdist cancel 1234
  srun --ntasks-per-node=1 hpcdist health --json --gpus 8 --run-dir runs/x   # the health gate, once per node
  hpcdist export runs/demo --out hf/demo             # newest checkpoint -> Hugging Face Llama directory
  hpcdist import hf/llama --out ckpt/llama           # Hugging Face Llama -> step-0 checkpoint
  hpcdist checkpoint convert runs/demo/checkpoints/step-00000200 --out dcp/demo --torch-save demo.pt  # stock torch
  hpcdist generate runs/demo --prompt "def main(" --max-new-tokens 64   # text from the newest checkpoint
  hpcdist eval runs/demo --data data/heldout --json eval.json          # loss and perplexity on held-out data
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


def _version() -> str:
    """The installed distribution's version; the package's ``__version__`` when it is not installed (a checkout on
    PYTHONPATH)."""
    from importlib import metadata

    try:
        return metadata.version("hpcdist")
    except metadata.PackageNotFoundError:
        from hpcdist import __version__

        return __version__


class _VersionAction(argparse.Action):
    """``--version``: the version is looked up only when asked for (not on every command)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        print(f"{parser.prog} {_version()}")  # stdout, like argparse's own version action
        parser.exit()


# The commands as `hpcdist --help` lists them, by what a user is doing. Every subcommand is in exactly one group
# (tests/unit/test_cli.py checks); the old spellings `prepare` and `tokenizer train` stay, listed under data.
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("run", ("train", "config", "plan", "report")),
    ("cluster jobs", ("submit", "status", "logs", "cancel")),
    ("data", ("data", "prepare", "tokenizer")),
    ("models", ("export", "import", "checkpoint", "generate", "eval")),
    ("diagnostics", ("health", "nccl-check")),
)
# Handed whole to the communication check's own parser (its flags are not hpcdist's).
NCCL_CHECK = ("nccl-check", "nccl_check")


class _TopParser(argparse.ArgumentParser):
    """``hpcdist``'s own parser: its help lists the subcommands by group, and a mistyped subcommand gets a
    did-you-mean instead of the list of every choice."""

    def format_help(self) -> str:
        commands = self._commands()
        lines = [self.format_usage().rstrip(), "", *textwrap.wrap(self.description or "", 118), ""]
        for title, names in GROUPS:
            lines.append(f"{title}:")
            for name in names:
                lines += textwrap.wrap(commands[name], 118, initial_indent=f"  {name:<11} ", subsequent_indent=" " * 14)
            lines.append("")
        lines += ["options:", "  -h, --help   show this help message and exit"]
        lines += ["  --version    print the installed hpcdist version and exit", "", self.epilog or ""]
        return "\n".join(lines)

    def _commands(self) -> dict[str, str]:
        """{subcommand: its one-line help}."""
        action = next(a for a in self._actions if isinstance(a, argparse._SubParsersAction))
        return {c.dest: c.help or "" for c in action._choices_actions}

    def check_command(self, argv: Sequence[str]) -> None:
        """Exit 2 with a did-you-mean when the first argument that is not an option is no subcommand."""
        first = next((a for a in argv if not a.startswith("-")), None)
        action = next(a for a in self._actions if isinstance(a, argparse._SubParsersAction))
        if first is None or first in action.choices or first in NCCL_CHECK:
            return
        import difflib

        close = difflib.get_close_matches(first, list(action.choices), n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        self.error(f"unknown command {first!r}{hint} (hpcdist --help lists the commands)")


def _parser() -> argparse.ArgumentParser:
    p = _TopParser(
        prog="hpcdist",
        description="Train Llama-style language models from one YAML config, locally or on SLURM: DDP, FSDP2/HSDP, "
        "DeepSpeed ZeRO 1-3, 3D (pipeline x data x tensor parallel), or auto (the planner picks the layout).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action=_VersionAction, help="print the installed hpcdist version and exit")
    # the subcommands are plain parsers: only the top one lists groups
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=argparse.ArgumentParser)

    t = sub.add_parser(
        "train",
        help="train from a config (one process, or one per rank under torchrun/srun)",
        description="Train from CONFIG with section.key=value overrides (CLI > YAML > preset > defaults). "
        "The rank layout is read from torchrun or SLURM (srun) variables, else one process. "
        "With checkpoint.resume=auto (the default) a rerun continues from the newest complete checkpoint.",
    )
    t.add_argument("config", help="YAML config, e.g. configs/demo.yaml")
    t.add_argument("overrides", nargs="*", metavar="section.key=value", help="e.g. train.steps=200 run.dir=runs/x")
    t.add_argument(
        "--dry-run",
        action="store_true",
        help="train nothing: validate the layout for --world-size ranks, build the model on the meta device, apply "
        "the parallel plan on a fake process group and print per-rank parameter counts and the memory estimate "
        "(no GPU needed); exit status 1 if the estimate does not fit the GPU",
    )
    t.add_argument("--world-size", type=_positive_int, help="with --dry-run: ranks to plan for (default 8)")
    t.add_argument("--cluster", help="with --dry-run: profile for GPUs per node and GPU memory (default a100_ib)")
    t.add_argument(
        "--ranks",
        help="with --dry-run: ranks to build, e.g. 0,7,31 or all (default: first, middle and last, and with pp the "
        "first rank of every pipeline stage)",
    )

    c = sub.add_parser(
        "config",
        help="validate a config and print it fully resolved; --reference lists every key",
        description="Load CONFIG plus overrides, validate every key, and print the resolved YAML the trainer uses. "
        "--reference [SECTION] lists every key with its type, default and meaning (docs/CONFIG.md); --commented "
        "prints CONFIG as a starter to edit, each key with its meaning and the model left to its preset.",
    )
    c.add_argument("config", nargs="?", help="YAML config, or a shipped example: demo, train_13b")
    c.add_argument("overrides", nargs="*", metavar="section.key=value", help="e.g. model.dim=512 train.steps=50")
    c.add_argument(
        "--world-size", type=_positive_int, default=1, help="also check batch divisibility for this many ranks"
    )
    c.add_argument(
        "--reference",
        nargs="?",
        const="",
        metavar="SECTION",
        help="list every config key (or one section's: run, model, data, optim, train, parallel, checkpoint, fault, "
        "logging) with type, default and meaning; no CONFIG needed",
    )
    c.add_argument(
        "--commented",
        action="store_true",
        help="print CONFIG as a starter config: each key with its meaning, the model section only what differs "
        "from its preset (so changing model.preset changes the model)",
    )

    prepare_help = "tokenize text / jsonl / parquet / datasets directories into memory-mapped token shards"
    _add_prepare_arguments(sub.add_parser("prepare", help=f"{prepare_help} (= data prepare)", **PREPARE))
    tk = sub.add_parser(
        "tokenizer",
        help="train a byte-level BPE tokenizer on local text (= data tokenizer)",
        description="hpcdist tokenizer train INPUT... --vocab-size N --out DIR (also: hpcdist data tokenizer "
        "INPUT... ...): a byte-level BPE (lossless on any text) trained with the tokenizers library; DIR gets "
        "tokenizer.json, usable as prepare --tokenizer DIR.",
    )
    tk_sub = tk.add_subparsers(dest="tokenizer_command", required=True, metavar="ACTION")
    _add_tokenizer_arguments(tk_sub.add_parser("train", help="train a byte-level BPE on local files"))
    dt = sub.add_parser(
        "data",
        help="prepare datasets, train a tokenizer, check a prepared dataset",
        description="hpcdist data prepare INPUT... --out DIR: tokenize documents into token shards; hpcdist data "
        "tokenizer INPUT... --vocab-size N --out DIR: train a byte-level BPE; hpcdist data check DIR [--full]: "
        "meta.json valid and every shard a regular file of the size it records (what training checks at start-up), "
        "--full also reads every shard: its sha256 and largest id. One line per problem naming the shard; exit "
        "status 1 if there is any.",
    )
    dt_sub = dt.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    _add_prepare_arguments(dt_sub.add_parser("prepare", help=prepare_help, **PREPARE))
    _add_tokenizer_arguments(dt_sub.add_parser("tokenizer", help="train a byte-level BPE tokenizer on local files"))
    dc = dt_sub.add_parser("check", help="verify a prepared dataset's shards (sizes; --full: checksums and ids)")
    dc.add_argument("path", type=Path, help="prepared dataset directory (hpcdist prepare --out DIR)")
    dc.add_argument("--full", action="store_true", help="read every shard: sha256 and largest id against meta.json")
    dc.add_argument("--workers", type=_positive_int, default=4, help="shards read at once with --full (default: 4)")
    sub.add_parser(
        "nccl-check",
        aliases=["nccl_check"],
        add_help=False,
        help="the communication check: environment audit, collective sweep, slow rank/host/link finder, verdict "
        "(tools/nccl_check; hpcdist nccl-check --help lists its options)",
    )
    _add_launch_parsers(sub)
    _add_plan_parser(sub)
    _add_health_parser(sub)
    _add_report_parser(sub)
    _add_hf_parsers(sub)
    _add_model_parsers(sub)
    return p


PREPARE: dict[str, Any] = dict(
    description="Tokenize documents into OUT/shard-*.bin + meta.json (docs/DATA.md), usable with data.source=files "
    "data.path=OUT. Inputs: text files (one document each), .jsonl / .jsonl.gz (--text-field), .parquet, and "
    "directories written by datasets' save_to_disk; other directories are searched recursively with --glob. "
    "Documents are separated by EOS (and start with BOS when the tokenizer has one). A killed run continues "
    "where it stopped when started again with the same arguments.",
)


def _add_prepare_arguments(pr: argparse.ArgumentParser) -> None:
    """`hpcdist prepare` and `hpcdist data prepare`: one set of arguments."""
    pr.add_argument("inputs", nargs="*", type=Path, help="files or directories (omit with --stdlib)")
    pr.add_argument("--out", type=Path, required=True, help="output directory")
    pr.add_argument(
        "--glob",
        default=DEFAULT_GLOB,
        help=f"comma-separated patterns for files inside directories (default: {DEFAULT_GLOB})",
    )
    pr.add_argument(
        "--stdlib", action="store_true", help="use this Python's standard library sources (the default corpus)"
    )
    pr.add_argument(
        "--tokenizer",
        default="byte",
        help="byte (default), a tokenizer.json or its directory, a SentencePiece .model, tiktoken:BPE_FILE, or a "
        "prepared dataset directory (its tokenizer)",
    )
    pr.add_argument("--text-field", default="text", help="jsonl key / parquet or datasets column (default: text)")
    pr.add_argument(
        "--workers",
        type=_positive_int,
        default=os.cpu_count() or 1,
        help="tokenizer processes (default: the CPU count)",
    )
    pr.add_argument(
        "--dtype",
        choices=("auto", "uint16", "uint32"),
        default="auto",
        help="token dtype; auto = uint16 when the vocabulary fits",
    )
    pr.add_argument("--shard-tokens", type=_positive_int, default=2**24, help="tokens per shard file")
    pr.add_argument("--max-tokens", type=_positive_int, default=None, help="stop after this many tokens")
    pr.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the dataset (or unfinished preparation) in a non-empty --out made from other inputs or options; "
        "without it prepare only continues its own preparation there",
    )
    pr.add_argument(
        "--cluster",
        metavar="PROFILE",
        help="prepare on the cluster: one SLURM job array of --tasks tasks (each a slice of the inputs into "
        "OUT/parts/<i>/) and a merge job after it (afterok) writing OUT/meta.json; the profile's cpus_per_task "
        "tokenizer processes per task (docs/DATA.md)",
    )
    pr.add_argument("--tasks", type=_positive_int, default=None, help="with --cluster: array tasks (slices)")
    pr.add_argument("--dry-run", action="store_true", help="with --cluster: print the array and the merge job")
    pr.add_argument("--after", metavar="JOB[:TYPE]", help="with --cluster: start the array after this job")
    pr.add_argument(
        "--megatron",
        metavar="PREFIX",
        type=Path,
        help="import a Megatron-LM indexed dataset (PREFIX.bin + PREFIX.idx) instead of tokenizing inputs; "
        "--tokenizer names the tokenizer that made it",
    )


def _add_tokenizer_arguments(tt: argparse.ArgumentParser) -> None:
    """`hpcdist tokenizer train` and `hpcdist data tokenizer`: one set of arguments."""
    tt.add_argument("inputs", nargs="+", type=Path, help="text / jsonl / parquet files, datasets or other directories")
    tt.add_argument("--vocab-size", type=_positive_int, required=True, help="vocabulary size, <|endoftext|> included")
    tt.add_argument("--out", type=Path, required=True, help="output directory (tokenizer.json)")
    tt.add_argument("--glob", default=DEFAULT_GLOB, help=f"patterns inside directories (default: {DEFAULT_GLOB})")
    tt.add_argument("--text-field", default="text", help="jsonl key / parquet or datasets column (default: text)")


def _add_health_parser(sub: argparse._SubParsersAction) -> None:
    h = sub.add_parser(
        "health",
        help="check this node before training on it: GPUs, a matmul, ECC/Xid errors, InfiniBand ports, disk, /dev/shm",
        description="The health gate (hpcdist.diagnostics.gate) on one node: visible GPUs vs --gpus, a short matmul on "
        "every GPU (on the CPU without one), uncorrectable ECC errors / pending page retirement / row remapping "
        "(nvidia-smi), hardware Xid errors (kernel log), InfiniBand ports ACTIVE when the NCCL profile uses IB, "
        "--run-dir writable with free space, /dev/shm free space. The fast checks end within --timeout, the "
        "device checks (torch import and CUDA start-up first) within --device-timeout. "
        "A check that cannot run here is skipped, never failed. Exit 0 healthy, 1 unhealthy, 2 bad arguments. "
        "On an allocation: srun --ntasks-per-node=1 hpcdist health --json --gpus 8 --run-dir RUN_DIR",
    )
    h.add_argument("--gpus", type=_nonnegative_int, help="GPUs this node must show (default: not checked)")
    h.add_argument("--run-dir", type=Path, help="the run's run.dir: must be writable with --min-free-gb free")
    h.add_argument("--min-free-gb", type=_at_least_zero, default=1.0, help="GiB free needed in --run-dir (default 1)")
    h.add_argument("--min-shm-gb", type=_at_least_zero, default=1.0, help="GiB free needed in /dev/shm (default 1)")
    h.add_argument(
        "--timeout", type=_positive_float, default=30.0, help="seconds for the fast checks together (default 30)"
    )
    h.add_argument(
        "--device-timeout",
        type=_positive_float,
        help="seconds for the GPU count and the matmul, torch import and CUDA start-up included; they run beside "
        "the fast checks (default: hpcdist.fault.health.DEFAULT_DEVICE_TIMEOUT_S, 120)",
    )
    h.add_argument(
        "--nccl-profile",
        help="the job's NCCL profile (name or YAML path): InfiniBand ports are checked when it uses IB "
        "(default: $HPCDIST_NCCL_PROFILE, set in submitted jobs)",
    )
    h.add_argument(
        "--xid-hours",
        type=_positive_float,
        default=24.0,
        help="hardware Xid errors logged in the kernel log this many hours back fail the node (default 24)",
    )
    h.add_argument(
        "--skip",
        action="append",
        default=[],
        metavar="CHECK[,CHECK]",
        help="checks not to run: gpus, matmul, nvidia_smi, xid, infiniband, run_dir, shm",
    )
    h.add_argument("--json", action="store_true", help='one JSON line: {"host", "ok", "reasons", "checks", "seconds"}')
    h.add_argument(
        "--record",
        action="store_true",
        help="when unhealthy, append the reasons to --run-dir's failures.jsonl (kind health: the restart policy "
        "excludes this host, hpcdist status shows why)",
    )


def _add_report_parser(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser(
        "report",
        help="write a run's report: one HTML page with every figure embedded, and the figures as PNGs",
        description="Read RUN_DIR (finished, running or crashed) and write report.html (self-contained: images "
        "embedded) and report/*.png: loss and eval loss vs step and tokens, throughput and MFU, memory, goodput "
        "by attempt, attempts/restarts/failures on a timeline, stragglers, ranks by host, the resolved config. "
        "Needs matplotlib: pip install 'hpcdist[plot]'.",
    )
    r.add_argument("run_dir", type=Path, help="the run's run.dir")
    r.add_argument("--out", type=Path, help="the HTML file (default RUN_DIR/report.html; PNGs in a folder beside it)")


def _add_launch_parsers(sub: argparse._SubParsersAction) -> None:
    """submit / status / logs / cancel: the SLURM side (hpcdist.launch)."""
    s = sub.add_parser(
        "submit",
        help="submit a training job to SLURM with submitit (refused when SLURM does not answer; --cluster local "
        "runs it on this machine)",
        description="Validate CONFIG + overrides for the cluster's world size, then submit one job: one rank per "
        "GPU via srun, --requeue, a warning signal before the time limit (the trainer checkpoints and "
        "requeues), the cluster's NCCL profile. Cluster settings come from the --cluster profile; the "
        "options below override them. Logs: <run.dir>/slurm/<jobid>_<rank>_log.out|err.",
    )
    s.add_argument("config", help="YAML training config, e.g. configs/train_13b.yaml")
    s.add_argument("overrides", nargs="*", metavar="section.key=value", help="e.g. train.steps=500 run.dir=runs/x")
    s.add_argument("--cluster", default="a100_ib", help="shipped profile name or a YAML path (default: a100_ib)")
    s.add_argument("--nodes", type=_positive_int, help="nodes to ask SLURM for (default: the profile's)")
    s.add_argument("--gpus-per-node", type=_nonnegative_int, help="also the ranks per node")
    s.add_argument("--time", help="time limit: minutes, HH:MM:SS or D-HH:MM:SS")
    for name in ("partition", "account", "qos", "constraint"):
        s.add_argument(f"--{name}", help=f"sbatch --{name} (default: the profile's)")
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
    s.add_argument(
        "--force",
        action="store_true",
        help="submit even when the planner predicts that the layout does not fit the GPUs' memory",
    )
    s.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="KEY=V1,V2,...",
        help="sweep KEY over the values (repeat for a grid): one SLURM job array, one run dir per task, "
        "<run.dir>/<its overrides>",
    )
    s.add_argument(
        "--snapshot",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the job from a copy of the code made now, in <run.dir>/code/ (git-tracked files of the checkout, "
        "or the installed package), so later edits change neither it nor its requeued attempts (default: on)",
    )
    s.add_argument("--sweep-file", type=Path, help="a YAML list of override mappings, one array task each")
    s.add_argument("--max-parallel", type=_positive_int, metavar="M", help="sweep tasks running at once (--array %%M)")
    s.add_argument(
        "--after",
        metavar="JOB[:TYPE]",
        help="start after job JOB ends: TYPE afterany (default), afterok or afternotok (sbatch --dependency)",
    )
    s.add_argument(
        "--chain",
        type=_positive_int,
        default=1,
        metavar="N",
        help="N jobs of this run, each starting when the previous ends (afterany) and resuming from its checkpoint; "
        "for clusters that cap the wall time and do not requeue (sets fault.requeue=false)",
    )

    st = sub.add_parser(
        "status", help="show a SLURM job (scontrol/sacct) or your queue (squeue)", description="Without JOB: squeue."
    )
    st.add_argument("job", nargs="?", help="job id (a sweep's array job id: every task's state, step and loss)")
    st.add_argument(
        "--run-dir",
        type=Path,
        help="the job's run.dir (a sweep's base run.dir): local-executor jobs, "
        "and jobs SLURM no longer knows, plain sbatch ones included",
    )

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
    lg.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="keep printing what the rank writes until the job ends (through requeues)",
    )

    ca = sub.add_parser(
        "cancel",
        help="cancel a SLURM job (scancel), or a local-executor job with --run-dir",
        description="On SLURM: scancel, then wait (up to 2 min) until the controller reports the job ended. A "
        "local-executor job: its ranks get SIGINT (checkpoint and stop), what still runs 60 s later is killed.",
    )
    ca.add_argument("job", help="job id")
    ca.add_argument("--run-dir", type=Path, help="the job's run.dir: finds a local-executor job's record")


def _gpu_mem(text: str) -> float:
    """``80GB`` / ``80GiB`` / ``80G`` / ``80`` -> 80.0 (GiB: an "A100-80GB" has 80 GiB)."""
    import re

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(?:G|GB|GiB)?\s*", text, re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a GPU memory size; give GiB like 80GB, 40GiB or 80")
    return float(m.group(1))


def _tokens(text: str) -> float:
    """``1T`` / ``262B`` / ``500M`` / ``2.5e11`` -> a positive token count."""
    import re

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([KMBT]?)\s*", text, re.IGNORECASE)
    value = float(m.group(1)) * {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}[m.group(2).upper()] if m else 0.0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count; give e.g. 1T, 262B, 500M or 2.5e11")
    return value


def _fraction(text: str) -> float:
    """A number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], e.g. 0.6, got {text}")
    return value


def _positive_float(text: str) -> float:
    """A number > 0 (seconds)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def _at_least_zero(text: str) -> float:
    """A number >= 0 (GiB of margin, a sampling temperature)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _add_plan_parser(sub: argparse._SubParsersAction) -> None:
    pl = sub.add_parser(
        "plan",
        help="estimate per-GPU memory of each strategy and rank parallel layouts by predicted throughput",
        description="Print (1) a table of per-GPU memory (params, grads, optimizer, activations, total) for ddp, "
        "zero1-3 (with CPU offload), fsdp and hsdp at CONFIG's micro batch and activation checkpointing, and "
        "(2) every layout (ddp, zero1-3, fsdp, hsdp, 3d with tp/pp/dp; each micro batch, checkpointing on/off) "
        "that fits --gpu-mem minus --mem-margin, ranked by predicted tokens/s/GPU with MFU, step time and days "
        "to train --tokens; then the row parallel.strategy=auto would take and why. Hardware numbers come from "
        "the --cluster profile's hardware: block; the time model is documented in docs/PLANNER.md. Exit status 1 "
        "when no layout fits.",
    )
    pl.add_argument("config", help="YAML training config, e.g. configs/train_13b.yaml")
    pl.add_argument("overrides", nargs="*", metavar="section.key=value", help="e.g. train.micro_batch_size=2")
    pl.add_argument("--cluster", default="a100_ib", help="shipped profile name or a YAML path (default a100_ib)")
    pl.add_argument("--nodes", type=_positive_int, help="default: the cluster profile's")
    pl.add_argument("--gpus-per-node", type=_positive_int, help="default: the cluster profile's")
    pl.add_argument("--gpu-mem", type=_gpu_mem, help="memory of one GPU, e.g. 80GB (default: the cluster profile's)")
    pl.add_argument(
        "--mem-margin", type=_at_least_zero, help="GiB kept free per GPU when deciding what fits (default 2)"
    )
    pl.add_argument("--efficiency", type=_fraction, help="fraction of bf16 peak the compute sustains (default 0.6)")
    pl.add_argument("--tokens", type=_tokens, help="tokens to train, e.g. 1T (default: steps x global batch x seq_len)")
    pl.add_argument("--top", type=_positive_int, default=10, help="fitting layouts to show (default 10)")
    pl.add_argument("--all", action="store_true", help="also show the best layouts that do not fit")
    pl.add_argument(
        "--plot",
        metavar="PNG",
        type=Path,
        help="draw the shown layouts' per-GPU memory (params, grads, "
        "optimizer, activations, buffers) as stacked bars against the GPU memory (needs hpcdist[plot])",
    )


def _add_hf_parsers(sub: argparse._SubParsersAction) -> None:
    ex = sub.add_parser(
        "export",
        help="write a checkpoint as a Hugging Face Llama directory (safetensors, config, tokenizer)",
        description="Convert CHECKPOINT_DIR (a step-XXXXXXXX directory, a checkpoints directory or a run directory: "
        "its newest complete checkpoint; any strategy and world size) into a Hugging Face LlamaForCausalLM directory "
        "OUT: config.json, model.safetensors (or shards + index above --max-shard-size), generation_config.json and "
        "the run's tokenizer. Streams tensor by tensor on CPU.",
    )
    ex.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="a step directory, checkpoints/ or a run directory")
    ex.add_argument("--out", type=Path, required=True, help="new output directory")
    ex.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="weights' dtype (default bf16)")
    ex.add_argument(
        "--max-shard-size",
        default=None,
        help="split the weights into files of at most this size, e.g. 2GB (default: one file)",
    )
    ex.add_argument(
        "--tokenizer", default=None, help="tokenizer to write (default: the one the run's data was prepared with)"
    )
    ex.add_argument("--no-tokenizer", action="store_true", help="write no tokenizer files")
    im = sub.add_parser(
        "import",
        help="turn a Hugging Face Llama directory into a step-0 hpcdist checkpoint",
        description="Read HF_DIR (config.json + safetensors of a LlamaForCausalLM) and write OUT/step-00000000: the "
        "weights in float32, no optimizer state. Resume from it (checkpoint.resume=OUT/step-00000000) or start from "
        "it (checkpoint.init_from); checkpoint.init_from=HF_DIR also reads HF_DIR directly. The model section of the "
        "config must match config.json.",
    )
    im.add_argument("hf_dir", metavar="HF_DIR", help="a Hugging Face Llama directory (config.json + safetensors)")
    im.add_argument("--out", type=Path, required=True, help="new checkpoints directory")
    ck = sub.add_parser(
        "checkpoint",
        help="convert a checkpoint step for stock torch (dcp.load, torch.load)",
        description="hpcdist checkpoint convert STEP_DIR --out DIR [--torch-save FILE]: hpcdist's shards hold raw "
        "tensor bytes that torch's own FileSystemReader cannot read; convert writes the step in DCP's stock encoding.",
    )
    ck_sub = ck.add_subparsers(dest="checkpoint_command", required=True, metavar="ACTION")
    cv = ck_sub.add_parser(
        "convert",
        help="write a checkpoint step in DCP's stock encoding (and optionally one torch.save file)",
        description="Verify STEP_DIR (a step-XXXXXXXX directory holding COMPLETE) as a named checkpoint.resume is: "
        "trusted, complete, every file's sha256 against its manifest; a damaged or untrusted one is refused. Then "
        "write its model and optimizer state to DIR with torch's stock FileSystemWriter (plus its "
        "trainer_state.json), which torch.distributed.checkpoint.load and dcp_to_torch_save read without hpcdist, "
        "and with --torch-save the same nested state dict as one torch.save file (what dcp_to_torch_save writes; "
        "torch.load(FILE, weights_only=True) reads it). One process, on CPU, the whole state in memory; nothing is "
        "written unless everything is.",
    )
    cv.add_argument("step_dir", type=Path, metavar="STEP_DIR", help="a step-XXXXXXXX checkpoint directory")
    cv.add_argument("--out", type=Path, metavar="DIR", required=True, help="new (or empty) output directory")
    cv.add_argument("--torch-save", type=Path, metavar="FILE", help="also write one torch.save file (must not exist)")


def _add_model_parsers(sub: argparse._SubParsersAction) -> None:
    where = (
        "CHECKPOINT: a run directory (its newest complete checkpoint), its checkpoints/ directory, or one "
        "step-N checkpoint of any strategy and world size; the model's shape and tokenizer come from the run's "
        "config.yaml and prepared data"
    )
    g = sub.add_parser(
        "generate",
        help="generate text from a trained checkpoint (one process, KV cache)",
        description=f"Continue --prompt with the trained model and print the text. {where}.",
    )
    g.add_argument("checkpoint", type=Path, metavar="CHECKPOINT", help="run directory, checkpoints/ or step-N/")
    g.add_argument("--prompt", required=True, help="text to continue")
    g.add_argument("--max-new-tokens", type=_positive_int, default=64, help="at most this many new tokens (64)")
    g.add_argument("--temperature", type=_at_least_zero, default=0.0, help="0 = greedy (default); > 0 samples")
    g.add_argument("--top-k", type=_nonnegative_int, default=0, help="sample among the k most likely (0 = all)")
    g.add_argument("--top-p", type=_fraction, default=1.0, help="nucleus sampling mass (1 = all)")
    g.add_argument("--seed", type=_nonnegative_int, default=0, help="sampling seed: the same seed, the same text")
    g.add_argument("--no-cache", action="store_true", help="re-run the whole sequence per token (slow; a reference)")
    g.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
    g.add_argument(
        "--tokenizer", default=None, help="tokenizer spec (default: the run's, or the Hugging Face directory's own)"
    )
    g.add_argument("--json", action="store_true", help="print one JSON object (text, token ids, stop reason, timing)")

    e = sub.add_parser(
        "eval",
        help="loss and perplexity of a trained checkpoint on a held-out prepared dataset",
        description=f"Mean next-token cross-entropy and perplexity on the first --batches batches of --data, read in "
        f"order (a directory made by `hpcdist prepare` with the run's tokenizer). {where}.",
    )
    e.add_argument("checkpoint", type=Path, metavar="CHECKPOINT", help="run directory, checkpoints/ or step-N/")
    e.add_argument("--data", type=Path, required=True, help="prepared dataset (hpcdist prepare --out DIR)")
    e.add_argument("--batches", type=_positive_int, help="batches to evaluate (default: the run's train.eval_batches)")
    e.add_argument("--seq-len", type=_positive_int, help="tokens per sample (default: the run's data.seq_len)")
    e.add_argument(
        "--batch-size", type=_positive_int, help="samples per batch (default: the run's train.global_batch_size)"
    )
    e.add_argument("--device", default="cpu", help="cpu (default), cuda, ...")
    e.add_argument("--json", type=Path, metavar="FILE", help="also write the result as JSON to FILE")


def _fail(msg: str, code: int = 2) -> int:
    print(f"hpcdist: {msg}", file=sys.stderr)
    return code


# Each command's body lives beside its library ("module:function"); the module is imported only when its command
# runs, so `hpcdist X --help` imports none of them (and none of torch).
COMMANDS: dict[str, str | Callable[[argparse.Namespace], int]] = {
    "train": "hpcdist.launch.commands:cmd_train",
    "dry-run": "hpcdist.planning.commands:cmd_dry_run",  # `train --dry-run`
    "config": "hpcdist.config.command:cmd_config",
    "prepare": "hpcdist.data.command:cmd_prepare",
    "tokenizer": "hpcdist.data.command:cmd_tokenizer",
    "data": "hpcdist.data.check:cmd_data",
    "submit": "hpcdist.launch.commands:cmd_submit",
    "status": "hpcdist.launch.commands:cmd_status",
    "logs": "hpcdist.launch.commands:cmd_logs",
    "cancel": "hpcdist.launch.commands:cmd_cancel",
    "plan": "hpcdist.planning.commands:cmd_plan",
    "report": "hpcdist.report.command:cmd_report",
    "health": "hpcdist.diagnostics.gate:cmd_health",
    "export": "hpcdist.hf.command:cmd_export",
    "import": "hpcdist.hf.command:cmd_import",
    "checkpoint": "hpcdist.checkpoint.convert:cmd_convert",  # its one action: convert
    "generate": "hpcdist.inference:cmd_generate",
    "eval": "hpcdist.inference:cmd_eval",
}


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "data" and args.data_command != "check":  # `data prepare` / `data tokenizer`: the old verbs
        args.command = {"prepare": "prepare", "tokenizer": "tokenizer"}[args.data_command]
    command = COMMANDS["dry-run" if args.command == "train" and args.dry_run else args.command]
    if args.command == "prepare" and getattr(args, "cluster", None) is not None:
        command = "hpcdist.launch.prepare_array:cmd_prepare_cluster"  # the SLURM side lives in hpcdist.launch
    if isinstance(command, str):
        import importlib

        module, _, name = command.partition(":")
        command = getattr(importlib.import_module(module), name)
    return command(args)


def main(argv: Sequence[str] | None = None) -> int:
    # first, before torch and numpy are imported: a stop signal during the imports and checks is remembered (the
    # trainer's stop flag acts on it) instead of killing the rank or breaking an import half-way (hpcdist.base.signals)
    signals.hold()
    try:
        try:
            return _main(argv)
        finally:  # a train that never reached its stop flag (a refusal, a config error), any other command
            signals.release()  # signals that arrived meanwhile get their normal action now
    except KeyboardInterrupt:  # the user's abort, not a bug: one line, the shell's status for Ctrl-C
        print("\nhpcdist: interrupted", file=sys.stderr, flush=True)
        return signals.ABORT_EXIT_CODE


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in NCCL_CHECK:  # its own parser and flags (tools/nccl_check is the same program)
        signals.release()
        from hpcdist.diagnostics.cli import main as nccl_check

        return nccl_check(argv[1:])
    parser = _parser()
    parser.check_command(argv)
    # overrides may follow options (`config X --world-size 2 train.steps=7`): argparse's nargs="*" positional
    # is consumed before the option, so collect the leftovers and accept those that look like key=value
    args, extra = parser.parse_known_args(argv)
    stray = [x for x in extra if x.startswith("-") or "=" not in x or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    if args.command != "train" or args.dry_run:
        # only a training run has a stop flag to take the held signals over: every other command (some run for
        # hours) gets Ctrl-C's KeyboardInterrupt (-> main's one line) and the other signals' normal action back now
        signals.release()
    from hpcdist.base.errors import CommandError
    from hpcdist.config import ConfigError

    # the one error wrapper: a command's refusal (CommandError, raised by the command or turned from its library's
    # errors by hpcdist.base.errors.refusing) and a config error are one line; anything else is _unexpected
    try:
        return _dispatch(args)
    except CommandError as e:
        return e.code if e.message is None else _fail(e.message, e.code)
    except ConfigError as e:
        return _fail(str(e))
    except BrokenPipeError:  # `hpcdist plan ... | head`: the reader left; not an error worth a traceback
        # point stdout at /dev/null so the interpreter's final flush does not raise the same error again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # the last resort: a bug, or an input no rule foresaw (each known one has its message);
        # BaseException: some libraries' errors are not Exceptions (DCP's CheckpointException)
        return _unexpected(e, args)


def _unexpected(e: BaseException, args: argparse.Namespace) -> int:
    """One line naming the error and where its traceback went (hpcdist.base.errors.keep_traceback), exit 1."""
    from hpcdist.base.errors import keep_traceback

    return _fail(f"unexpected error: {keep_traceback(e, _run_dir(args))}", code=1)


def _run_dir(args: argparse.Namespace) -> str | None:
    """The command's run.dir if its config loads (the error may have come from anywhere, loading included)."""
    if not hasattr(args, "overrides") or not getattr(args, "config", None):
        return None
    from hpcdist import config as config_mod

    try:
        return config_mod.load(args.config, args.overrides).run.dir
    except Exception:  # no run.dir then: the traceback goes to a temp file
        return None


if __name__ == "__main__":
    sys.exit(main())
