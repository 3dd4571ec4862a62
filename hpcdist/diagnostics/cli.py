"""``nccl_check`` command line: flags -> :class:`Options`, then one rank per process.

Under ``srun`` (one task per GPU) or ``torchrun`` every process is one rank (hpcdist.env reads the launcher's
variables). ``--nproc N`` starts N ranks on this machine itself, torchrun-style, and returns their verdict.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hpcdist.diagnostics.names import DTYPE_NAMES, OPS

__all__ = ["build_parser", "launch_local", "main", "parse_message_size"]

_SIZE = re.compile(r"(\d+)\s*([KMGT]?)(?:I?B)?", re.IGNORECASE)
_EXIT_GRACE_S = 3.0  # after rank 0 is done (or any rank failed), how long the others get before they are killed


def parse_message_size(text: str) -> int:
    """'8' -> 8, '64K' / '64KB' / '64KiB' -> 65536, '1G' -> 2**30 (binary, like nccl-tests)."""
    match = _SIZE.fullmatch(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; use e.g. 8, 64K, 16M, 1G")
    return int(match.group(1)) << (10 * " KMGT".index(match.group(2).upper() or " "))


def _positive_arg(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def check(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {getattr(kind, '__name__', 'value')}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
        return value

    return check


def _ops(text: str) -> tuple[str, ...]:
    ops = tuple(o.strip() for o in text.split(",") if o.strip())
    unknown = [o for o in ops if o not in OPS]
    if unknown or not ops:
        raise argparse.ArgumentTypeError(
            f"unknown operation(s) {', '.join(unknown) or text!r}; choose from {', '.join(OPS)}"
        )
    return ops


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nccl_check",
        description="Communication diagnostic: audit the environment, check every device, sweep the collectives "
        "like nccl-tests (time, algbw, busbw, #wrong), find slow ranks/hosts/links, and give a PASS/FAIL verdict "
        "(exit 0/1). Run one process per GPU under srun or torchrun, or --nproc N locally.",
        epilog="test-only fault injection (never on real jobs): HPCDIST_NCCL_CHECK_INJECT_WRONG_RANK, _DELAY_RANK, "
        "_DELAY_S, _HANG_RANK, _HANG_AT (join|sweep), _HANG_S; see hpcdist/diagnostics/faults.py",
    )
    p.add_argument("--nproc", type=_positive_arg(int), help="start N ranks on this machine (no launcher needed)")
    p.add_argument("--ops", type=_ops, default=OPS, help=f"comma-separated subset of {','.join(OPS)} (default: all)")
    p.add_argument("-b", "--min-bytes", type=parse_message_size, default=8, help="smallest message (default 8)")
    p.add_argument(
        "-e", "--max-bytes", type=parse_message_size, help="largest message (default 1G on GPUs, 16M on CPU)"
    )
    p.add_argument("-f", "--step-factor", type=_positive_arg(int), default=2, help="size multiplier (default 2)")
    p.add_argument("-n", "--iters", type=_positive_arg(int), default=20, help="timed iterations per size (default 20)")
    p.add_argument("-w", "--warmup", type=int, default=5, help="warm-up iterations per size (default 5)")
    p.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default="float32")
    p.add_argument(
        "--timeout",
        type=_positive_arg(float),
        default=120.0,
        help="seconds any one step may take before the run is declared hung (default 120)",
    )
    p.add_argument(
        "--join-timeout",
        type=_positive_arg(float),
        default=300.0,
        help="seconds to wait for every rank to join (default 300)",
    )
    p.add_argument("--no-sweep", dest="sweep", action="store_false", help="skip the collective sweep")
    p.add_argument("--no-finder", dest="finder", action="store_false", help="skip the slow node / link finder")
    p.add_argument(
        "--finder-bytes", type=parse_message_size, help="bytes per finder transfer (default 64M GPU, 4M CPU)"
    )
    p.add_argument("--finder-iters", type=_positive_arg(int), default=5, help="timed transfers per pair (default 5)")
    p.add_argument(
        "--slow-threshold",
        type=_positive_arg(float),
        help="a rank/host is slow below this fraction of the typical bandwidth (default 0.7 on GPUs; "
        "0.3 on CPU, where ranks share cores with everything else and timings are noisier)",
    )
    p.add_argument(
        "--cluster",
        default="auto",
        help="expected busbw from cluster profile NAME's hardware: (or a YAML path, or none); "
        "auto = a100_ib with NCCL, none on CPU",
    )
    p.add_argument("--expect-intra", type=_positive_arg(float), help="expected intra-node all_reduce busbw, GB/s")
    p.add_argument("--expect-inter", type=_positive_arg(float), help="expected inter-node all_reduce busbw, GB/s")
    p.add_argument("--tolerance", type=float, default=0.8, help="PASS at >= this x expected (default 0.8)")
    p.add_argument(
        "--nccl-profile",
        default=os.environ.get("HPCDIST_NCCL_PROFILE"),
        help="apply NCCL profile NAME (or a YAML path) in every task first, as training does (default: "
        "$HPCDIST_NCCL_PROFILE; none = use the environment as it is)",
    )
    p.add_argument("--requeue-signal", default="USR2", help="the job's requeue signal, for the audit (default USR2)")
    p.add_argument("--json", metavar="PATH", help="write every number as JSON to PATH ('-': stdout, report to stderr)")
    p.add_argument(
        "--plot",
        metavar="PNG",
        help="draw busbw vs message size per collective (expected busbw as lines) "
        "and the finder's pairwise bandwidth as heat maps into PNG (needs matplotlib: hpcdist[plot])",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    # torch (and everything that runs a rank) only now: --help and a bad flag answer in a fraction of a second
    import torch

    from hpcdist.diagnostics.runner import Options, apply_profile, run_rank
    from hpcdist.diagnostics.verdict import load_expectation
    from hpcdist.env import from_environ

    env = from_environ()
    if args.nproc:
        if env.launcher != "single":
            print(
                f"nccl_check: --nproc is for local runs; this process is already rank {env.rank} of "
                f"{env.world_size} ({env.launcher})",
                file=sys.stderr,
            )
            return 2
        return launch_local(args.nproc, _without_nproc(argv))
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # a forked rank inherits the parent's pool size
    gpu = env.device.startswith("cuda")
    cluster = ("a100_ib" if env.backend == "nccl" else "none") if args.cluster == "auto" else args.cluster
    try:
        expect = load_expectation(cluster, intra=args.expect_intra, inter=args.expect_inter, tolerance=args.tolerance)
        if args.warmup < 0:
            raise ValueError(f"--warmup {args.warmup}: must be >= 0")
        opts = Options(
            ops=args.ops,
            min_bytes=args.min_bytes,
            max_bytes=args.max_bytes or ((1 << 30) if gpu else (16 << 20)),
            step_factor=args.step_factor,
            iters=args.iters,
            warmup=args.warmup,
            dtype=args.dtype,
            timeout_s=args.timeout,
            join_timeout_s=args.join_timeout,
            sweep=args.sweep,
            finder=args.finder,
            finder_bytes=args.finder_bytes or ((64 << 20) if gpu else (4 << 20)),
            finder_iters=args.finder_iters,
            slow_threshold=args.slow_threshold or (0.7 if gpu else 0.3),
            expect=expect,
            requeue_signal=args.requeue_signal,
            json_path=args.json,
            plot_path=args.plot,
        )
        if opts.max_bytes < opts.min_bytes:
            raise ValueError(f"--max-bytes {opts.max_bytes} is below --min-bytes {opts.min_bytes}")
    except ValueError as err:
        print(f"nccl_check: {err}", file=sys.stderr)
        return 2
    profile = apply_profile(args.nccl_profile, env)
    return run_rank(env, opts, profile=profile, out=sys.stderr if args.json == "-" else sys.stdout)


def _without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local(nproc: int, argv: list[str]) -> int:
    """Start ``nproc`` ranks here with torchrun's variables; 0 only if every rank exits 0.

    On a CPU-only torch the ranks are forked from this process (torch is already imported: ~0.1 s per rank
    instead of seconds); with CUDA they are fresh interpreters, since a CUDA context does not survive fork.
    When rank 0 has finished or any rank failed, the rest get a few seconds and are then killed, the way torchrun
    and `srun --kill-on-bad-exit` treat a job whose rank is stuck.
    """
    base = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
    }
    if not os.environ.get("OMP_NUM_THREADS"):
        base["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    import torch  # already imported by main()

    fork = torch.version.cuda is None
    children: dict[int, int | subprocess.Popen] = {}
    for rank in range(nproc):
        rank_env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        if fork:
            pid = os.fork()
            if pid == 0:
                _forked_rank(rank_env, argv)
            children[rank] = pid
        else:
            root = str(Path(__file__).resolve().parents[2])
            path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
            cmd = [sys.executable, "-m", "hpcdist.diagnostics", *argv]
            children[rank] = subprocess.Popen(cmd, env={**os.environ, **rank_env, "PYTHONPATH": path})
    return _wait(children)


def _forked_rank(rank_env: dict[str, str], argv: list[str]) -> None:
    code = 1
    try:
        os.environ.update(rank_env)
        code = main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _poll(child: int | subprocess.Popen) -> int | None:
    if isinstance(child, subprocess.Popen):
        return child.poll()
    pid, status = os.waitpid(child, os.WNOHANG)
    return None if pid == 0 else os.waitstatus_to_exitcode(status)


def _kill(child: int | subprocess.Popen, sig: int) -> None:
    try:
        if isinstance(child, subprocess.Popen):
            child.send_signal(sig)
        else:
            os.kill(child, sig)
    except ProcessLookupError:
        pass


def _wait(children: dict[int, int | subprocess.Popen]) -> int:
    codes: dict[int, int] = {}
    give_up_at: float | None = None
    signalled = 0
    try:
        while len(codes) < len(children):
            for rank, child in children.items():
                if rank not in codes and (code := _poll(child)) is not None:
                    codes[rank] = code
            if give_up_at is None and (0 in codes or any(codes.values())):
                give_up_at = time.monotonic() + _EXIT_GRACE_S
            if give_up_at is not None and time.monotonic() > give_up_at:
                sig = signal.SIGTERM if signalled == 0 else signal.SIGKILL
                for rank, child in children.items():
                    if rank not in codes:
                        _kill(child, sig)
                signalled += 1
                give_up_at = time.monotonic() + _EXIT_GRACE_S
            time.sleep(0.05)
    except KeyboardInterrupt:
        for child in children.values():
            _kill(child, signal.SIGTERM)
        raise
    if all(c == 0 for c in codes.values()):
        return 0
    return codes[0] if codes.get(0, 0) > 0 else 1
