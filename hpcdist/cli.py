"""``hpcdist`` command line: argument parsing over the library (``train`` runs hpcdist.run, ``submit`` hpcdist.launch).
Configuration errors print one message, no traceback; anything unforeseen prints one line naming the error and the
file that holds its traceback (exit 1)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hpcdist import signals

DEFAULT_GLOB = "*.txt,*.jsonl,*.jsonl.gz,*.parquet"  # prepare / tokenizer train: files inside directories

EPILOG = """examples:
  hpcdist train configs/demo.yaml                      # one process on this machine
  hpcdist train configs/demo.yaml train.steps=50 run.dir=runs/try
  hpcdist train configs/train_13b.yaml --dry-run --world-size 32   # check the 32-GPU layout here, no GPU
  torchrun --nproc_per_node=2 -m hpcdist.cli train configs/demo.yaml
  srun --ntasks-per-node=8 hpcdist train configs/train_13b.yaml   # one task per GPU
  hpcdist config configs/demo.yaml model.dim=512        # print the resolved, validated config
  hpcdist tokenizer train ~/corpus --vocab-size 32000 --out data/tok   # byte-level BPE from local text
  hpcdist prepare ~/corpus --tokenizer data/tok --out data/corpus      # txt / jsonl / parquet -> token shards
  hpcdist submit configs/train_13b.yaml --nodes 4 --partition gpu   # sbatch through submitit (8 ranks/node)
  hpcdist plan configs/train_13b.yaml --nodes 4 --gpus-per-node 8  # memory per strategy + ranked layouts
  hpcdist submit configs/demo.yaml --cluster local --wait          # no SLURM: ranks as local processes
  hpcdist submit configs/demo.yaml --cluster sandbox --dry-run     # print the sbatch script, submit nothing
  hpcdist submit configs/demo.yaml --sweep optim.lr=1e-4,3e-4 --sweep train.global_batch_size=256,512  # 1 array
  hpcdist submit configs/demo.yaml --chain 3                         # 3 jobs, each resuming the previous one
  hpcdist status 1234; hpcdist logs 1234 --rank 3 --err; hpcdist cancel 1234
  hpcdist export runs/demo --out hf/demo             # newest checkpoint -> Hugging Face Llama directory
  hpcdist import hf/llama --out ckpt/llama           # Hugging Face Llama -> step-0 checkpoint
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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hpcdist",
        description="Train Llama-style language models from one YAML config, locally or on SLURM: DDP, FSDP2/HSDP, "
        "DeepSpeed ZeRO 1-3, 3D (pipeline x data x tensor parallel), or auto (the planner picks the layout).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action=_VersionAction, help="print the installed hpcdist version and exit")
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
        help="tokenize text / jsonl / parquet / datasets directories into memory-mapped token shards",
        description="Tokenize documents into OUT/shard-*.bin + meta.json (docs/DATA.md), usable with data.source=files "
        "data.path=OUT. Inputs: text files (one document each), .jsonl / .jsonl.gz (--text-field), .parquet, and "
        "directories written by datasets' save_to_disk; other directories are searched recursively with --glob. "
        "Documents are separated by EOS (and start with BOS when the tokenizer has one). A killed run continues "
        "where it stopped when started again with the same arguments.",
    )
    pr.add_argument("inputs", nargs="*", type=Path, help="files or directories (omit with --stdlib)")
    pr.add_argument("--out", type=Path, required=True, help="output directory")
    pr.add_argument(
        "--glob", default=DEFAULT_GLOB,
        help=f"comma-separated patterns for files inside directories (default: {DEFAULT_GLOB})",
    )  # fmt: skip
    pr.add_argument(
        "--stdlib", action="store_true", help="use this Python's standard library sources (the default corpus)"
    )
    pr.add_argument(
        "--tokenizer", default="byte",
        help="byte (default), a tokenizer.json or its directory, a SentencePiece .model, tiktoken:BPE_FILE, or a "
        "prepared dataset directory (its tokenizer)",
    )  # fmt: skip
    pr.add_argument("--text-field", default="text", help="jsonl key / parquet or datasets column (default: text)")
    pr.add_argument("--workers", type=_positive_int, default=os.cpu_count() or 1,
                    help="tokenizer processes (default: the CPU count)")  # fmt: skip
    pr.add_argument("--dtype", choices=("auto", "uint16", "uint32"), default="auto",
                    help="token dtype; auto = uint16 when the vocabulary fits")  # fmt: skip
    pr.add_argument("--shard-tokens", type=_positive_int, default=2**24, help="tokens per shard file")
    pr.add_argument("--max-tokens", type=_positive_int, default=None, help="stop after this many tokens")
    pr.add_argument(
        "--overwrite", action="store_true",
        help="replace the dataset (or unfinished preparation) in a non-empty --out made from other inputs or options; "
        "without it prepare only continues its own preparation there",
    )  # fmt: skip
    pr.add_argument(
        "--megatron", metavar="PREFIX", type=Path,
        help="import a Megatron-LM indexed dataset (PREFIX.bin + PREFIX.idx) instead of tokenizing inputs; "
        "--tokenizer names the tokenizer that made it",
    )  # fmt: skip

    tk = sub.add_parser(
        "tokenizer",
        help="train a byte-level BPE tokenizer on local text",
        description="hpcdist tokenizer train INPUT... --vocab-size N --out DIR: a byte-level BPE (lossless on any "
        "text) trained with the tokenizers library; DIR gets tokenizer.json, usable as prepare --tokenizer DIR.",
    )
    tk_sub = tk.add_subparsers(dest="tokenizer_command", required=True, metavar="ACTION")
    tt = tk_sub.add_parser("train", help="train a byte-level BPE on local files")
    tt.add_argument("inputs", nargs="+", type=Path, help="text / jsonl / parquet files, datasets or other directories")
    tt.add_argument("--vocab-size", type=_positive_int, required=True, help="vocabulary size, <|endoftext|> included")
    tt.add_argument("--out", type=Path, required=True, help="output directory (tokenizer.json)")
    tt.add_argument("--glob", default=DEFAULT_GLOB, help=f"patterns inside directories (default: {DEFAULT_GLOB})")
    tt.add_argument("--text-field", default="text", help="jsonl key / parquet or datasets column (default: text)")
    _add_launch_parsers(sub)
    _add_plan_parser(sub)
    _add_report_parser(sub)
    _add_hf_parsers(sub)
    _add_model_parsers(sub)
    return p


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
        help="submit a training job to SLURM with submitit (local processes when no SLURM answers)",
        description="Validate CONFIG + overrides for the cluster's world size, then submit one job: one rank per "
        "GPU via srun, --requeue, a warning signal before the time limit (the trainer checkpoints and "
        "requeues), the cluster's NCCL profile. Cluster settings come from the --cluster profile; the "
        "options below override them. Logs: <run.dir>/slurm/<jobid>_<rank>_log.out|err.",
    )
    s.add_argument("config", help="YAML training config, e.g. configs/train_13b.yaml")
    s.add_argument("overrides", nargs="*", metavar="section.key=value")
    s.add_argument("--cluster", default="a100_ib", help="shipped profile name or a YAML path (default: a100_ib)")
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
    s.add_argument(
        "--force", action="store_true",
        help="submit even when the planner predicts that the layout does not fit the GPUs' memory",
    )  # fmt: skip
    s.add_argument(
        "--sweep", action="append", default=[], metavar="KEY=V1,V2,...",
        help="sweep KEY over the values (repeat for a grid): one SLURM job array, one run dir per task, "
        "<run.dir>/<its overrides>",
    )  # fmt: skip
    s.add_argument(
        "--snapshot", action=argparse.BooleanOptionalAction, default=True,
        help="run the job from a copy of the code made now, in <run.dir>/code/ (git-tracked files of the checkout, "
        "or the installed package), so later edits change neither it nor its requeued attempts (default: on)",
    )  # fmt: skip
    s.add_argument("--sweep-file", type=Path, help="a YAML list of override mappings, one array task each")
    s.add_argument("--max-parallel", type=_positive_int, metavar="M", help="sweep tasks running at once (--array %%M)")
    s.add_argument(
        "--after", metavar="JOB[:TYPE]",
        help="start after job JOB ends: TYPE afterany (default), afterok or afternotok (sbatch --dependency)",
    )  # fmt: skip
    s.add_argument(
        "--chain", type=_positive_int, default=1, metavar="N",
        help="N jobs of this run, each starting when the previous ends (afterany) and resuming from its checkpoint; "
        "for clusters that cap the wall time and do not requeue (sets fault.requeue=false)",
    )  # fmt: skip

    st = sub.add_parser(
        "status", help="show a SLURM job (scontrol/sacct) or your queue (squeue)", description="Without JOB: squeue."
    )
    st.add_argument("job", nargs="?", help="job id (a sweep's array job id: every task's state, step and loss)")
    st.add_argument("--run-dir", type=Path, help="the job's run.dir (a sweep's base run.dir): local-executor jobs, "
                    "and jobs SLURM no longer knows, plain sbatch ones included")  # fmt: skip

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

    ca = sub.add_parser("cancel", help="cancel a SLURM job (scancel), or a local-executor job with --run-dir")
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
    pl.add_argument("overrides", nargs="*", metavar="section.key=value")
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
    ex.add_argument("checkpoint", metavar="CHECKPOINT_DIR")
    ex.add_argument("--out", type=Path, required=True, help="new output directory")
    ex.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="weights' dtype (default bf16)")
    ex.add_argument("--max-shard-size", default=None,
                    help="split the weights into files of at most this size, e.g. 2GB (default: one file)")  # fmt: skip
    ex.add_argument("--tokenizer", default=None,
                    help="tokenizer to write (default: the one the run's data was prepared with)")  # fmt: skip
    ex.add_argument("--no-tokenizer", action="store_true", help="write no tokenizer files")
    im = sub.add_parser(
        "import",
        help="turn a Hugging Face Llama directory into a step-0 hpcdist checkpoint",
        description="Read HF_DIR (config.json + safetensors of a LlamaForCausalLM) and write OUT/step-00000000: the "
        "weights in float32, no optimizer state. Resume from it (checkpoint.resume=OUT/step-00000000) or start from "
        "it (checkpoint.init_from); checkpoint.init_from=HF_DIR also reads HF_DIR directly. The model section of the "
        "config must match config.json.",
    )
    im.add_argument("hf_dir", metavar="HF_DIR")
    im.add_argument("--out", type=Path, required=True, help="new checkpoints directory")


def _add_model_parsers(sub: argparse._SubParsersAction) -> None:
    where = ("CHECKPOINT: a run directory (its newest complete checkpoint), its checkpoints/ directory, or one "
             "step-N checkpoint of any strategy and world size; the model's shape and tokenizer come from the run's "
             "config.yaml and prepared data")  # fmt: skip
    g = sub.add_parser(
        "generate",
        help="generate text from a trained checkpoint (one process, KV cache)",
        description=f"Continue --prompt with the trained model and print the text. {where}.",
    )
    g.add_argument("checkpoint", type=Path, metavar="CHECKPOINT")
    g.add_argument("--prompt", required=True, help="text to continue")
    g.add_argument("--max-new-tokens", type=_positive_int, default=64, help="at most this many new tokens (64)")
    g.add_argument("--temperature", type=_at_least_zero, default=0.0, help="0 = greedy (default); > 0 samples")
    g.add_argument("--top-k", type=_nonnegative_int, default=0, help="sample among the k most likely (0 = all)")
    g.add_argument("--top-p", type=_fraction, default=1.0, help="nucleus sampling mass (1 = all)")
    g.add_argument("--seed", type=_nonnegative_int, default=0, help="sampling seed: the same seed, the same text")
    g.add_argument("--no-cache", action="store_true", help="re-run the whole sequence per token (slow; a reference)")
    g.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer spec (default: the run's, or the Hugging Face directory's own)")  # fmt: skip
    g.add_argument("--json", action="store_true", help="print one JSON object (text, token ids, stop reason, timing)")

    e = sub.add_parser(
        "eval",
        help="loss and perplexity of a trained checkpoint on a held-out prepared dataset",
        description=f"Mean next-token cross-entropy and perplexity on the first --batches batches of --data, read in "
        f"order (a directory made by `hpcdist prepare` with the run's tokenizer). {where}.",
    )
    e.add_argument("checkpoint", type=Path, metavar="CHECKPOINT")
    e.add_argument("--data", type=Path, required=True, help="prepared dataset (hpcdist prepare --out DIR)")
    e.add_argument("--batches", type=_positive_int, help="batches to evaluate (default: the run's train.eval_batches)")
    e.add_argument("--seq-len", type=_positive_int, help="tokens per sample (default: the run's data.seq_len)")
    e.add_argument("--batch-size", type=_positive_int,
                   help="samples per batch (default: the run's train.global_batch_size)")  # fmt: skip
    e.add_argument("--device", default="cpu", help="cpu (default), cuda, ...")
    e.add_argument("--json", type=Path, metavar="FILE", help="also write the result as JSON to FILE")


def _fail(msg: str, code: int = 2) -> int:
    print(f"hpcdist: {msg}", file=sys.stderr)
    return code


def cmd_train(args: argparse.Namespace) -> int:
    if args.dry_run:
        return cmd_dry_run(args)
    given = [f"--{name.replace('_', '-')}" for name in ("world_size", "cluster", "ranks") if getattr(args, name)]
    if given:
        return _fail(
            f"train: {', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only with --dry-run "
            "(a real run takes its ranks from torchrun or srun)"
        )
    from hpcdist.checkpoint import CheckpointMismatch, CheckpointUnavailable
    from hpcdist.config import ConfigError
    from hpcdist.fault.nonfinite import NonFiniteError
    from hpcdist.hf.source import ConversionError
    from hpcdist.launch.job import SlurmEnvironment
    from hpcdist.run import main as run_main

    try:
        return run_main(args.config, args.overrides, job=SlurmEnvironment()).exit_code
    except (ConfigError, CheckpointMismatch, ConversionError) as e:  # one readable message, once per job
        return _config_error_once(e)
    except CheckpointUnavailable as e:  # storage, not input: recorded in failures.jsonl, retried by the policy
        return _config_error_once(e, code=e.EXIT_CODE)
    except NonFiniteError as e:  # every rank stops at the same step (the norm is global): say it once
        return _config_error_once(e, code=1)


def _config_error_once(e: Exception, code: int = 2) -> int:
    """An error every rank of ``hpcdist train`` has alike (config, checkpoint mismatch, non-finite step), printed
    once per job rather than by every rank: rank 0 prints it and the others exit with the same status silently.
    Problems with run.dir / checkpoint.dir depend on the host's mounts, so the first rank of every node prints
    those, naming its host."""
    from hpcdist.env import from_environ

    try:
        env = from_environ(cuda_available=False)  # rank, local rank and host only: no CUDA initialization
    except ValueError:  # a garbled launcher environment: print, as a single process would
        return _fail(str(e), code=code)
    if env.rank == 0:
        return _fail(str(e), code=code)
    if getattr(e, "per_host", False) and env.local_rank == 0:
        return _fail(f"rank {env.rank} on {env.hostname}: {e}", code=code)
    return code  # every rank exits alike


def cmd_dry_run(args: argparse.Namespace) -> int:
    from hpcdist import config as config_mod
    from hpcdist.planning.dryrun import dry_run, parse_ranks
    from hpcdist.planning.memory import GIB

    cfg = config_mod.load(args.config, args.overrides)
    _warn_data(cfg)
    world = args.world_size or 8
    try:
        ranks = None if args.ranks is None else parse_ranks(args.ranks, world)  # None: the dry run's default
        report = dry_run(cfg, world, cluster=args.cluster or "a100_ib", ranks=ranks)
    except (ValueError, RuntimeError) as e:
        if isinstance(e, config_mod.ConfigError):
            raise
        return _fail(f"train --dry-run: {e}")
    print(report.text(), end="", flush=True)
    if report.fits is False:
        return _fail(
            f"train --dry-run: the memory estimate ({report.memory.total / GIB:.1f} GiB per GPU) does not fit; "
            "see hpcdist plan for layouts that do",
            code=1,
        )
    return 0


def _warn_data(cfg: Any) -> None:
    """A dry run plans a job without its data: a missing dataset or a vocabulary mismatch is a warning there."""
    from hpcdist import config as config_mod

    for problem in config_mod.check_data(cfg, strict=False):
        print(f"hpcdist: warning: {problem}", file=sys.stderr, flush=True)


def cmd_config(args: argparse.Namespace) -> int:
    from hpcdist import config as config_mod

    cfg = config_mod.load(args.config, args.overrides)
    _warn_data(cfg)
    config_mod.check_world(cfg, args.world_size)
    print(config_mod.dump(cfg), end="")
    return 0


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


def cmd_prepare(args: argparse.Namespace) -> int:
    from hpcdist.data import load_tokenizer, prepare_corpus, stdlib_corpus
    from hpcdist.data.corpora import CorpusError

    if args.megatron is not None:
        return _import_megatron(args)
    try:
        files: list[Path] = [*(stdlib_corpus() if args.stdlib else []), *_inputs(args.inputs, args.glob)]
    except CorpusError as e:
        return _fail(f"prepare: {e}")
    if not files:
        return _fail("prepare: no input files (give files/directories, check --glob, or pass --stdlib)")
    try:
        tok = load_tokenizer(args.tokenizer)
        res = prepare_corpus(
            files, args.out, tokenizer=tok, text_field=args.text_field, shard_tokens=args.shard_tokens,
            dtype=args.dtype, max_tokens=args.max_tokens, workers=args.workers, progress=sys.stderr,
            overwrite=args.overwrite,
        )  # fmt: skip
    except (ValueError, OSError) as e:  # TokenizerError and CorpusError are ValueErrors
        return _fail(f"prepare: {e}")
    if res.up_to_date:
        print(f"prepared {len(files)} files into {res.path}: already up to date ({res.num_tokens:,} tokens)")
        return 0
    kept = f", {res.kept_shards} shards kept from an interrupted run" if res.kept_shards else ""
    print(f"prepared {len(files)} files into {res.path}: {res.num_documents:,} documents, {res.num_tokens:,} tokens "
          f"(tokenizer {tok.kind}, vocab {tok.vocab_size:,}){kept}; {res.mb_per_s:.2f} MB/s, "
          f"{res.tokens_per_s:,.0f} tokens/s with {args.workers} workers")  # fmt: skip
    return 0


def _import_megatron(args: argparse.Namespace) -> int:
    from hpcdist.data import load_tokenizer
    from hpcdist.data.megatron import import_megatron

    if args.inputs or args.stdlib:
        return _fail("prepare: --megatron imports PREFIX.bin/.idx; give no other inputs")
    try:
        tok = load_tokenizer(args.tokenizer)
        res = import_megatron(args.megatron, args.out, tokenizer=tok, shard_tokens=args.shard_tokens, dtype=args.dtype,
                              overwrite=args.overwrite)  # fmt: skip
    except (ValueError, OSError) as e:
        return _fail(f"prepare: {e}")
    print(f"imported Megatron dataset {args.megatron} into {res.path}: {res.num_documents:,} documents, "
          f"{res.num_tokens:,} tokens (tokenizer {tok.kind}, vocab {tok.vocab_size:,})")  # fmt: skip
    return 0


def cmd_tokenizer(args: argparse.Namespace) -> int:
    from hpcdist.data import train_bpe
    from hpcdist.data.corpora import CorpusError

    try:
        inputs = _inputs(args.inputs, args.glob)
        if not inputs:
            return _fail("tokenizer train: no input files (check --glob)")
        tok = train_bpe(inputs, vocab_size=args.vocab_size, out_dir=args.out, text_field=args.text_field)
    except (CorpusError, ValueError, OSError) as e:
        return _fail(f"tokenizer train: {e}")
    print(f"trained a byte-level BPE of {tok.vocab_size:,} tokens on {len(inputs)} files into "
          f"{args.out / 'tokenizer.json'} (EOS {tok.eos_id}); "
          f"use it with: hpcdist prepare ... --tokenizer {args.out}")  # fmt: skip
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    from hpcdist.launch import load_cluster
    from hpcdist.launch.slurm_cli import SlurmError
    from hpcdist.launch.submit import LaunchError, submit_chain

    names = ("nodes", "gpus_per_node", "time", "partition", "account", "qos", "constraint", "exclude", "job_name")
    params = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    if args.sbatch_args:  # added to the cluster's own extra flags, not instead of them
        params["extra_sbatch"] = [*load_cluster(args.cluster).extra_sbatch, *args.sbatch_args]
    common = dict(cluster=args.cluster, dry_run=args.dry_run, force=args.force, after=args.after,
                  snapshot=args.snapshot, **params)  # fmt: skip
    sweep = bool(args.sweep or args.sweep_file)
    if sweep and args.chain > 1:
        return _fail("submit: --chain and --sweep do not combine; chain each task's run separately")
    try:
        if sweep:
            from hpcdist.launch.sweep import submit_sweep

            out: Any = submit_sweep(args.config, args.overrides, sweep=args.sweep, sweep_file=args.sweep_file,
                                    max_parallel=args.max_parallel, **common)  # fmt: skip
        else:
            out = submit_chain(args.config, args.overrides, args.chain, **common)
            out = out[0] if args.dry_run else out
        if isinstance(out, str):
            print(out, end="" if out.endswith("\n") else "\n")  # the shell prompt then starts on a line of its own
            return 0
        first = out[0]
        logs = first.paths[0]
        if sweep:
            array = first.job_id.split("_")[0]
            print(f"submitted sweep as job array {array} ({len(out)} tasks, {first.num_tasks} ranks each)\n"
                  f"  logs:   {first.folder}/{array}_<task>_<rank>_log.out|err\n"
                  f"  follow: hpcdist status {array}", flush=True)  # fmt: skip
        else:
            chained = f"; then {', '.join(h.job_id for h in out[1:])} (chained, afterany)" if len(out) > 1 else ""
            code = f"\n  code:   {first.snapshot}" if first.snapshot else ""
            print(f"submitted job {first.job_id} ({first.executor}, {first.num_tasks} ranks){chained}{code}\n"
                  f"  logs:   {logs.stdout}\n          {logs.stderr}\n"
                  f"  follow: hpcdist status {first.job_id}; hpcdist logs {first.job_id} --rank R",
                  flush=True)  # fmt: skip
        if not args.wait:
            return 0
        if not sweep:
            from hpcdist.launch.follow import follow

            # rank 0's log streams while the (first) job runs, through requeues; its end stops the stream
            print(f"--- {logs.stdout} (until the job ends; Ctrl-C stops waiting, not the job)", flush=True)
            follow(lambda: logs.stdout, first.done, sys.stdout, poll_s=2.0)
        states = [h.wait() for h in out]
        for handle, state in zip(out, states, strict=True):
            print(f"job {handle.job_id} finished: {state}")
        return 0 if all(state == "COMPLETED" for state in states) else 1
    except (LaunchError, SlurmError) as e:
        return _fail(f"submit: {e}")
    except KeyboardInterrupt:
        return _fail("submit: stopped waiting; the job keeps running", code=130)


def _local_record(job: str | None, run_dir: Path | None) -> dict[str, Any] | None:
    """The run dir's record of a local-executor job (None: not local, or no --run-dir)."""
    if job is None or run_dir is None:
        return None
    from hpcdist.launch.records import find_job

    entry = find_job(job, run_dir)
    return entry if entry is not None and entry.get("executor") == "local" else None


def cmd_status(args: argparse.Namespace) -> int:
    from hpcdist.launch import records, slurm_cli
    from hpcdist.launch.sweep import sweep_status

    try:
        table = sweep_status(args.job, args.run_dir) if args.job else None
        if table is not None:
            print(table)
            return 0
        local = _local_record(args.job, args.run_dir)
        if local is not None:
            print(f"job {args.job} (local executor on {local.get('host')}, {local.get('num_tasks')} ranks): "
                  f"{records.local_state(local)}\n{records.run_summary(args.run_dir)}\n"
                  f"logs: {local.get('folder')}/{args.job}_<rank>_log.out|err")  # fmt: skip
            return 0
        try:
            print(slurm_cli.status_text(args.job))
        except slurm_cli.SlurmError:
            if args.run_dir is None:
                raise
            # SLURM forgot the job (or cannot answer): what the run dir knows, plain sbatch jobs included
            print(f"job {args.job}: SLURM does not know it now; from the run dir:")
        if args.run_dir is not None:
            print(records.run_summary(args.run_dir, args.job))
    except slurm_cli.SlurmError as e:
        return _fail(f"status: {e}")
    except records.UntrustedFile as e:  # another user's jobs.jsonl: its records name pids and folders
        return _fail(f"status: {e}")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    import shutil

    from hpcdist.atomic import UntrustedFile
    from hpcdist.launch import slurm_cli

    try:
        if args.follow:
            return _follow_log(args)
        local = _local_record(args.job, args.run_dir)
        if local is not None:  # a local job's log folder is recorded in the run dir (it may be a log_dir)
            path = Path(local["folder"]) / f"{args.job}_{args.rank}_log.{'err' if args.err else 'out'}"
        else:
            path = slurm_cli.log_path(args.job, rank=args.rank, err=args.err, run_dir=args.run_dir)
        with path.open(encoding="utf-8", errors="replace") as f:
            shutil.copyfileobj(f, sys.stdout)
    except slurm_cli.SlurmError as e:
        return _fail(f"logs: {e}")
    except UntrustedFile as e:
        return _fail(f"logs: {e}")
    except OSError as e:
        return _fail(f"logs: cannot read {e.filename}: {e.strerror}")
    return 0


def _follow_log(args: argparse.Namespace) -> int:
    """`logs --follow`: the log may not exist yet (the job is pending); the job's state ends the stream."""
    from hpcdist.launch import slurm_cli
    from hpcdist.launch.follow import follow

    slurm_cli.check_job_id(args.job)

    def path() -> Path | None:
        try:
            return slurm_cli.log_path(args.job, rank=args.rank, err=args.err, run_dir=args.run_dir)
        except slurm_cli.SlurmError:
            return None  # pending: no log yet

    def finished() -> bool:
        try:
            state = slurm_cli.job_state(args.job)
        except slurm_cli.SlurmError:
            return False  # the controller is busy: ask again
        return state is None or state.split()[0].rstrip("+") in slurm_cli.TERMINAL_STATES

    try:
        follow(path, finished, sys.stdout, poll_s=2.0)
    except KeyboardInterrupt:
        return 130
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    from hpcdist.launch import records, slurm_cli

    try:
        local = _local_record(args.job, args.run_dir)
        if local is not None:
            records.cancel_local(local, args.run_dir)
        else:
            slurm_cli.cancel(args.job)
    except (slurm_cli.SlurmError, records.UntrustedFile) as e:
        return _fail(f"cancel: {e}")
    except OSError as e:
        return _fail(f"cancel: {e}")
    print(f"cancelled job {args.job}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from hpcdist.report.page import write_report
    from hpcdist.report.plots import MissingMatplotlib
    from hpcdist.rundir import RunDir

    if not args.run_dir.is_dir():
        return _fail(f"report: {args.run_dir} is not a directory (give the run's run.dir)")
    rd = RunDir(args.run_dir)
    out = args.out or rd.report
    images = rd.report_images if args.out is None else out.with_suffix("")  # report.html -> report/
    try:
        page, pngs = write_report(args.run_dir, out, images)
    except MissingMatplotlib as e:
        return _fail(f"report: {e}")
    drawn = [p.name for p in pngs.values() if p is not None]
    print(f"wrote {page} and {len(drawn)} figure(s) in {images}/: {', '.join(drawn) or 'none (nothing recorded)'}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    import textwrap

    from hpcdist import config as config_mod
    from hpcdist.launch import load_cluster
    from hpcdist.planning import layouts as planner
    from hpcdist.planning.memory import GIB, plan_table

    cfg = config_mod.load(args.config, args.overrides)
    shape = {k: v for k, v in (("nodes", args.nodes), ("gpus_per_node", args.gpus_per_node)) if v is not None}
    cluster = load_cluster(args.cluster, **shape)
    if cluster.gpus_per_node < 1:
        return _fail(f"plan: cluster {cluster.name!r} has no GPUs; pass --gpus-per-node or a GPU --cluster")
    try:
        hw = planner.cluster_hardware(
            cluster, gpu_mem_gb=args.gpu_mem, efficiency=args.efficiency, margin_gib=args.mem_margin
        )
    except ValueError as e:
        return _fail(f"plan: {e}")
    args_model, world = cfg.model_args(), cluster.nodes * cluster.gpus_per_node
    print(
        plan_table(
            args_model,
            nodes=cluster.nodes,
            gpus_per_node=cluster.gpus_per_node,
            gpu_mem_gb=hw.gpu_mem_gb,
            micro_batch_size=cfg.train.micro_batch_size,
            seq_len=cfg.data.seq_len,
            activation_checkpointing=cfg.train.activation_checkpointing,
        )
    )
    t = cfg.train
    estimates = planner.rank_layouts(
        args_model,
        world_size=world,
        gpus_per_node=cluster.gpus_per_node,
        global_batch_size=t.global_batch_size,
        seq_len=cfg.data.seq_len,
        hw=hw,
        reduce_bytes=planner.grad_reduce_bytes(cfg),
    )
    if not estimates:
        return _fail(
            f"plan: no layout splits train.global_batch_size={t.global_batch_size} over {world} GPUs; "
            f"make it a multiple of {world}"
        )
    tokens = args.tokens if args.tokens is not None else t.steps * t.global_batch_size * cfg.data.seq_len
    print(
        planner.layout_table(
            estimates, args=args_model, gpus_per_node=cluster.gpus_per_node, seq_len=cfg.data.seq_len,
            global_batch_size=t.global_batch_size, hw=hw, tokens=tokens, top=args.top, show_all=args.all,
        ),
        end="",
        flush=True,  # before the error line on stderr
    )  # fmt: skip
    if args.plot:
        from hpcdist.planning.plot import write_memory_plot
        from hpcdist.report.plots import MissingMatplotlib

        fitting = [e for e in estimates if e.fits]  # the table's rows: the top fitting, with --all the top others
        shown = [*fitting[: args.top], *([e for e in estimates if not e.fits][: args.top] if args.all else [])]
        try:
            print(f"plot: {write_memory_plot(shown, args.plot, gpu_mem_gb=hw.gpu_mem_gb, margin_gib=hw.margin_gib)}")
        except MissingMatplotlib as e:
            return _fail(f"plan --plot: {e}")
    if not any(e.fits for e in estimates):
        smallest = min(e.memory.total for e in estimates) / GIB
        return _fail(
            f"plan: none of {len(estimates)} layouts fits: the smallest needs {smallest:.1f} GiB per GPU, "
            f"{hw.gpu_mem_gb - hw.margin_gib:g} GiB usable (--gpu-mem minus --mem-margin); add nodes, shorten "
            "data.seq_len or lower train.global_batch_size (--all lists them)",
            code=1,
        )
    try:
        _, chosen, reason = planner.pick(cfg, estimates, world, cluster.gpus_per_node)
    except config_mod.ConfigError as e:
        print(f"auto: {e}")
        return 0
    keys = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in planner.layout_overrides(chosen.layout)]
    print(textwrap.fill(f"auto would take {reason}", width=118, subsequent_indent="  "))
    print(textwrap.fill(f"as overrides: {' '.join(keys)}", width=118, initial_indent="  ", subsequent_indent="    "))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from hpcdist.hf.export import export, parse_shard_size

    try:
        max_shard = parse_shard_size(args.max_shard_size) if args.max_shard_size else None
        res = export(args.checkpoint, args.out, dtype=args.dtype, max_shard_size=max_shard,
                     tokenizer=args.tokenizer, with_tokenizer=not args.no_tokenizer)  # fmt: skip
    except (ValueError, OSError) as e:  # ConversionError, HFConfigError, TokenizerError, ConfigError: one line
        return _fail(f"export: {e}")
    shards = sum(f.endswith(".safetensors") for f in res.files)
    print(f"exported {res.checkpoint} to {res.out}: {res.total_bytes / 1e6:,.1f} MB of {args.dtype} weights in "
          f"{shards} file(s), {', '.join(res.files)} ({res.seconds:.1f} s)")  # fmt: skip
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from hpcdist.hf.import_ import import_checkpoint

    try:
        path = import_checkpoint(args.hf_dir, args.out)
    except (ValueError, OSError) as e:
        return _fail(f"import: {e}")
    print(f"imported {args.hf_dir} as {path} (weights only: the optimizer starts fresh)")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    import json

    from hpcdist.checkpoint import CheckpointMismatch
    from hpcdist.inference import load_for_inference
    from hpcdist.models.generation import PromptTooLong, SamplingConfig, generate

    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k or None, top_p=args.top_p)
    try:
        model, tok, _ = load_for_inference(args.checkpoint, device=args.device, tokenizer=args.tokenizer)
        if tok is None:
            return _fail(
                f"generate: {args.checkpoint} records no tokenizer (synthetic data, or an imported "
                "checkpoint): pass --tokenizer SPEC (byte, a tokenizer.json or its directory, prepared data)"
            )
        prompt = [int(i) for i in tok.encode_batch([args.prompt])[0]]
        if tok.add_bos and tok.bos_id is not None:  # documents were prepared framed by BOS: prompts are too
            prompt = [tok.bos_id, *prompt]
        t0 = time.perf_counter()
        res = generate(
            model, prompt, max_new_tokens=args.max_new_tokens, sampling=sampling, eos_id=tok.eos_id,
            vocab_limit=tok.vocab_size, seed=args.seed, use_cache=not args.no_cache,
        )  # fmt: skip
        seconds = time.perf_counter() - t0
    except (PromptTooLong, CheckpointMismatch, ValueError, OSError) as e:  # bad input of any kind: one line
        return _fail(f"generate: {e}")
    text = tok.decode(res.tokens)
    if args.json:
        print(json.dumps({"prompt": args.prompt, "text": text, "prompt_ids": prompt, "new_ids": res.tokens,
                          "stop": res.stop, "seconds": seconds}))  # fmt: skip
    else:
        print(args.prompt + text, flush=True)
        rate = len(res.tokens) / seconds if seconds > 0 else 0.0
        print(f"hpcdist: {len(res.tokens)} new tokens in {seconds:.2f}s ({rate:.1f} tokens/s), stopped at {res.stop}",
              file=sys.stderr)  # fmt: skip
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    import json

    from hpcdist.atomic import atomic_write
    from hpcdist.checkpoint import CheckpointMismatch
    from hpcdist.data import TokenDataset
    from hpcdist.inference import check_eval_data, dataset_loss, load_for_inference
    from hpcdist.models.hf_config import is_hf_dir

    if is_hf_dir(args.checkpoint):  # its tokenizer, seq_len and batch sizes come from the run: a HF directory has none
        return _fail(f"eval: {args.checkpoint} is a Hugging Face directory; give the hpcdist checkpoint it was "
                     "exported from (or run lm-eval-harness on it: README)")  # fmt: skip
    try:
        model, _, loaded = load_for_inference(args.checkpoint, device=args.device)
        cfg = loaded.config
        assert cfg is not None  # a hpcdist checkpoint records the config that trained it
        check_eval_data(cfg, args.data)  # before any batch: the same ids must mean the same text
        seq_len = args.seq_len or cfg.data.seq_len
        if seq_len > model.args.max_seq_len:
            return _fail(f"eval: --seq-len {seq_len} exceeds the model's max_seq_len={model.args.max_seq_len}")
        dataset = TokenDataset(args.data, seq_len, key="--data")  # every shard checked before the first batch
        res = dataset_loss(
            model, dataset, batches=args.batches or cfg.train.eval_batches,
            batch_size=args.batch_size or cfg.train.global_batch_size,
        )  # fmt: skip
    except (CheckpointMismatch, ValueError, OSError) as e:  # bad input of any kind: one line
        return _fail(f"eval: {e}")
    out = {"checkpoint": str(loaded.checkpoint), "data": str(args.data), "seq_len": seq_len, **res.to_dict()}
    print(f"eval {loaded.checkpoint} on {args.data}: loss {res.loss:.4f}, perplexity {res.perplexity:.2f} "
          f"({res.batches} batches, {res.tokens:,} tokens)")  # fmt: skip
    if args.json:
        atomic_write(args.json, json.dumps(out, indent=2) + "\n")
    return 0


COMMANDS = {
    "train": cmd_train,
    "config": cmd_config,
    "prepare": cmd_prepare,
    "tokenizer": cmd_tokenizer,
    "submit": cmd_submit,
    "status": cmd_status,
    "logs": cmd_logs,
    "cancel": cmd_cancel,
    "plan": cmd_plan,
    "report": cmd_report,
    "export": cmd_export,
    "import": cmd_import,
    "generate": cmd_generate,
    "eval": cmd_eval,
}


def main(argv: Sequence[str] | None = None) -> int:
    # first, before torch and numpy are imported: a stop signal during the imports and checks is remembered (the
    # trainer's stop flag acts on it) instead of killing the rank or breaking an import half-way (hpcdist.signals)
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
    parser = _parser()
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
    from hpcdist.config import ConfigError

    try:
        return COMMANDS[args.command](args)
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
    """One line naming the error and where its traceback went: a file in run.dir when that directory exists (it
    stays with the run), else a new private temp file. Exit 1."""
    text = "".join(traceback.format_exception(e))
    try:
        where = _write_traceback(text, _run_dir(args))
    except OSError as err:  # even the temp directory refused: say so, still in one line
        where = f"nowhere: writing it failed ({err.strerror})"
    what = " ".join(f"{type(e).__name__}: {e}".split())
    if len(what) > 300:
        what = f"{what[:300]}..."
    return _fail(f"unexpected error: {what} (the traceback is in {where}; please report it)", code=1)


def _run_dir(args: argparse.Namespace) -> str | None:
    """The command's run.dir if its config loads (the error may have come from anywhere, loading included)."""
    if not hasattr(args, "overrides") or not getattr(args, "config", None):
        return None
    from hpcdist import config as config_mod

    try:
        return config_mod.load(args.config, args.overrides).run.dir
    except Exception:  # no run.dir then: the traceback goes to a temp file
        return None


def _write_traceback(text: str, run_dir: str | None) -> str:
    from hpcdist.atomic import atomic_write
    from hpcdist.rundir import RunDir

    target = RunDir(run_dir or ".").error_log(time.strftime("%Y%m%d-%H%M%S"), os.getpid())
    name = target.name
    if run_dir and os.path.isdir(run_dir):
        try:
            return str(atomic_write(target, text))
        except OSError:
            pass  # a read-only or full run.dir: the temp file below
    fd, path = tempfile.mkstemp(prefix=name.removesuffix(".log") + "-", suffix=".log")  # O_EXCL, mode 0600
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    return path


if __name__ == "__main__":
    sys.exit(main())
