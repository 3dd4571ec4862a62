"""Run a function on N real ranks (fork-started processes, gloo process group on CPU).

Fork, not spawn: each spawned rank re-imports torch (~20 s for 8 ranks on 2 cores); forked ranks start in
~0.3 s. Each child builds its DistEnv from torchrun-style variables, exactly like a torchrun launch.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hpcdist.env import DistEnv, destroy_process_group, from_environ, init_process_group

# Rendezvous ports for the tests' process groups: below Linux's ephemeral range (32768+, where the kernel picks
# the port of every outgoing connection, gloo's among them, and of every bind to port 0) and below the range
# hpcdist.env.port_from_job_id gives the sandbox's SLURM jobs (20000+). A port the kernel handed out as free
# (bind to 0) was often someone else's by the time the store listened on it: EADDRINUSE with three test workers.
# Each xdist worker takes its own slice, so two workers never try the same port.
_PORTS = range(12000, 20000)
_next_port: list[int] = []


def free_port() -> int:
    """A port nobody listens on, never handed out twice in this test process, from this worker's own slice."""
    if not _next_port:
        workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
        worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0) % workers
        size = len(_PORTS) // workers
        _next_port.extend([_PORTS.start + worker * size, _PORTS.start + (worker + 1) * size])
    start, end = _next_port
    for port in range(start, end):
        with socket.socket() as s:
            try:
                s.bind(("", port))  # every address, as the store listens; no SO_REUSEADDR: TIME_WAIT is skipped
            except OSError:
                continue
        _next_port[0] = port + 1
        return port
    raise RuntimeError(f"no free port left in {start}-{end - 1} for this test worker")


def rank_environ(rank: int, world: int, port: int) -> None:
    """This forked process becomes rank ``rank`` of ``world`` on one host, as torchrun would set it up."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_RUN_ID="test",
    )
    torch.set_num_threads(1)


def _child(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, q: Any) -> None:
    rank_environ(rank, world, port)
    try:
        env = from_environ(cuda_available=False)
        init_process_group(env, timeout_s=120)
        # plain pickle bytes: the queue's own pickler would share tensors through file descriptors that die
        # with this process before the parent reads them
        q.put((rank, "ok", pickle.dumps(fn(env, *args))))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))
    finally:
        destroy_process_group()


def train_cli_and_exit(config_file: Path, log: Path) -> None:
    """In a forked rank: ``hpcdist train CONFIG`` through the CLI's own main, stdout and stderr into ``log``, then
    exit with its status (forked: the interpreter's start and torch's import are skipped)."""
    out = open(log, "w", buffering=1)  # noqa: SIM115  # the process's stdout and stderr until it exits
    os.dup2(out.fileno(), 1)
    os.dup2(out.fileno(), 2)
    sys.stdout = sys.stderr = out
    from hpcdist.cli import main

    code = 1
    try:
        code = main(["train", str(config_file)])
    finally:
        out.flush()
        os._exit(code)


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 300) -> list[Any]:
    """Return [fn(env, *args) for each rank]; raise with the failing rank's traceback if any rank fails."""
    return fork_ranks(world, _child, (fn, args), timeout=timeout)


def fork_ranks(world: int, target: Callable[..., None], extra: tuple[Any, ...], *, timeout: float) -> list[Any]:
    """Fork ``world`` processes running ``target(rank, world, port, *extra, queue)``, each putting one (rank, "ok",
    pickled result) or (rank, status, traceback) on the queue; their results in rank order."""
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *extra, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, status, value = q.get(timeout=timeout)
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


def single(fn: Callable[..., Any], *args: Any) -> Any:
    """fn on one rank, in this process, with no process group (the plain `hpcdist train` path)."""
    env = from_environ({}, cuda_available=False)
    assert isinstance(env, DistEnv) and env.world_size == 1
    return fn(env, *args)
