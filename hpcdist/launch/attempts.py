"""The attempt loop of a batch job: ``python -m hpcdist.launch.attempts [--run-dir DIR | CONFIG ...] -- STEP ...``.

Run by the batch shell in place of its training srun, on both entry points: ``sbatch sbatch/*.sh``
(sbatch/common.sh hpcdist_train) and ``hpcdist submit`` (a shell function ``srun`` in the generated script's setup
lines routes submitit's srun line here). Each attempt:

    gate        the health gate on every allocated node not yet excluded (:func:`run_gate`: ``python -m hpcdist
                health --json`` once per node through srun, with ``--gpus`` the GPUs per node the job asked the
                scheduler for, when it asked for any); a node that fails it is out for this job
    choose      N training nodes: healthy, not blamed; N = allocated - fault.spare_nodes, or fewer down to
                fault.min_nodes (fewer data-parallel replicas, the same global batch: the resharding resume)
    step        ``srun --nodes=N --ntasks=N*tasks_per_node --nodelist=<chosen> ...``: the step's
                SLURM_STEP_NODELIST names the chosen nodes, so rank 0 (the rendezvous) is the first chosen node;
                HPCDIST_ATTEMPT numbers the attempt (JobFacts.restart_count: ledgers, failure records, heartbeats)
    on failure  the failure policy (hpcdist.launch.restarts.decide_failure: attribution, fault.max_failures,
                fault.max_same_failure) decides: stop, or restart. A restart is in-job (after
                fault.restart_backoff_s) while enough healthy nodes remain, else a requeue as before (bad hosts
                excluded)

A stop signal (TERM: scancel, preemption, ``scontrol requeue``) and the time-limit path (the trainer checkpoints and
rank 0 requeues) end the loop as before: it never restarts a step it was asked to stop. USR2 / TERM sent to this
process are forwarded to the running srun (sbatch's ``--signal=B:USR2@lead`` reaches the batch shell only).

The scheduler's side (the allocation, the gate's step, the step command restricted to the chosen nodes) is its
Launcher's (hpcdist.schedulers); SLURM's words above are its example. Outside a batch job (no job, or no node
list) the command runs once, unchanged.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcdist.base.untrusted import one_line
from hpcdist.fault.failures import record
from hpcdist.fault.health import (
    DEFAULT_DEVICE_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    gate_wall_s,
    health_argv,
    read_verdicts,
    record_unhealthy,
)
from hpcdist.launch import restarts
from hpcdist.schedulers import ATTEMPT_ENV, JobFacts, job_facts, launcher

__all__ = ["AttemptPlan", "choose_nodes", "main", "plan_from_env", "run_gate", "step_for"]

GATE_UNAVAILABLE = "gate unavailable"
_MAX_BACKOFF_S = 60.0
_STORE_START_S = 120.0  # the rendezvous store's start: an interpreter and torch's import on a busy batch node
_SPARE_EXIT_S = 60.0  # spares leave within a second of the store's end mark; then they are killed


def _announce(msg: str) -> None:
    print(f"[hpcdist attempts {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------------ the gate


def run_gate(
    nodes: Sequence[str],
    *,
    run_dir: str | None = None,
    gpus: int | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    device_timeout: float = DEFAULT_DEVICE_TIMEOUT_S,
    python: str | None = None,
) -> dict[str, tuple[bool, list[str]]]:
    """The health gate on ``nodes``: ``hpcdist health --json`` once per node in one step (hpcdist.fault.health
    owns its command line and reads its answers). ``gpus``: the GPUs per node the job asked the scheduler for
    (each node must show them), None when it asked for none. {host: (ok, reasons)}. Where the gate command does
    not exist (exit 2 without a verdict: an hpcdist without it), every node counts as healthy with the reason "gate
    unavailable"; a node that gave no verdict in time is unhealthy."""
    if not nodes:
        return {}
    python = python or os.environ.get("HPCDIST_PYTHON") or sys.executable
    argv = health_argv(gpus=gpus, run_dir=run_dir, timeout_s=timeout, device_timeout_s=device_timeout, python=python)
    # 30 s more than the gate's own bound: the step's start and the verdicts' way back
    answer = launcher().run_gate(nodes, argv, timeout=gate_wall_s(timeout, device_timeout) + 30)
    if answer is None:
        return {n: (True, [GATE_UNAVAILABLE]) for n in nodes}
    out, rc = answer
    if rc == 2 and '"host"' not in out:
        return {n: (True, [GATE_UNAVAILABLE]) for n in nodes}
    return {host: (not reasons, reasons) for host, reasons in read_verdicts(out, list(nodes)).items()}


# ------------------------------------------------------------------------------------------------ nodes


@dataclass(frozen=True)
class AttemptPlan:
    """The allocation and what the job trains on: ``train_nodes`` (N), at least ``min_nodes``; ``gpus_per_node``:
    what the job asked the scheduler for (None: no GPU, e.g. a CPU partition)."""

    allocated: list[str]
    train_nodes: int
    min_nodes: int
    tasks_per_node: int
    gpus_per_node: int | None = None


def plan_from_env(environ: Mapping[str, str], spare: int, min_nodes: int) -> AttemptPlan | str:
    """The plan of this allocation, or why the loop cannot choose nodes (then the command runs unchanged)."""
    held = launcher().allocation(environ)
    if isinstance(held, str):
        return held
    train = len(held.nodes) - spare
    if train < 1:
        return f"fault.spare_nodes={spare} leaves no training node of the {len(held.nodes)} allocated"
    floor = min_nodes if 0 < min_nodes <= train else train
    return AttemptPlan(held.nodes, train, floor, max(1, held.tasks_per_node), held.gpus_per_node)


def choose_nodes(plan: AttemptPlan, bad: set[str]) -> list[str] | None:
    """The next attempt's nodes in allocation order (spares last by position): the first N good ones, fewer down to
    plan.min_nodes; None when fewer good nodes remain."""
    good = [n for n in plan.allocated if n not in bad]
    if len(good) < plan.min_nodes:
        return None
    return good[: plan.train_nodes]


def step_for(cmd: Sequence[str], plan: AttemptPlan, chosen: Sequence[str]) -> list[str]:
    """``cmd`` (the batch script's step command) restricted to ``chosen`` when that is not the whole allocation."""
    if sorted(chosen) == sorted(plan.allocated):
        return list(cmd)
    return launcher().step_command(cmd, chosen, plan.tasks_per_node)


# ------------------------------------------------------------------------------------------------ the loop


class _Step:
    """The running step, with USR1 / USR2 / TERM / INT forwarded to it; remembers a stop request (TERM / INT), and a
    USR1 / USR2 that came while no step ran (during the gate or the backoff): the next step gets it once its
    tasks had time to start (the step launcher relays a signal only to launched tasks; hpcdist holds it from its
    first line)."""

    RELAY_AFTER_S = 3.0

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.stopping = False
        self.stopped_at: float | None = None  # when the stop signal came: a requeue's recovery starts there
        self.pending: list[int] = []
        for sig in (signal.SIGUSR2, signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._forward)

    def _forward(self, signum: int, _frame: Any) -> None:
        if signum in (signal.SIGTERM, signal.SIGINT):
            self.stopping = True
            self.stopped_at = self.stopped_at or time.time()
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(OSError):  # it ended meanwhile
                self.proc.send_signal(signum)
        elif signum in (signal.SIGUSR1, signal.SIGUSR2) and signum not in self.pending:
            self.pending.append(signum)

    def run(self, cmd: Sequence[str], env: dict[str, str]) -> int:
        self.proc = proc = subprocess.Popen(list(cmd), env=env)
        started = time.monotonic()
        while True:
            try:
                rc = proc.wait(timeout=0.5 if self.pending else None)
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() - started >= self.RELAY_AFTER_S:
                    for signum in self.pending:
                        with contextlib.suppress(OSError):
                            proc.send_signal(signum)
                    self.pending.clear()
            except InterruptedError:
                continue
        self.proc = None
        return rc if rc >= 0 else 128 - rc


def run_recoverable(
    step: _Step,
    cmd: Sequence[str],
    plan: AttemptPlan,
    chosen: Sequence[str],
    spares: Sequence[str],
    env: dict[str, str],
) -> int:
    """One attempt under in-process recovery (hpcdist.fault.inprocess): a rendezvous store on this node (the batch
    shell's: it lives as long as the job), the training step on ``chosen`` and warm spares on ``spares`` (one
    process per task slot), both steps with a task's death leaving the other tasks running. Returns the training's
    exit status: rank 0's when it reported the training's end to the store (a step that lost a task but recovered
    ends with that task's status), else the step's. Without a store (it did not start) the attempt runs as
    before."""
    from hpcdist.fault.inprocess import SPARE_ENV, STORE_ENV, WORLD_ENV

    python = env.get("HPCDIST_PYTHON") or sys.executable
    store = subprocess.Popen([python, "-m", "hpcdist.fault.regroup"], stdout=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line.strip()) for line in store.stdout or ()], daemon=True)
    reader.start()
    try:
        port = int(lines.get(timeout=_STORE_START_S))
    except (queue.Empty, ValueError):
        _announce("the rendezvous store did not start: this attempt runs without in-process recovery")
        _end(store)
        return step.run(step_for(cmd, plan, chosen), env)
    host = launcher().batch_host(os.environ) or plan.allocated[0]
    shared = {**env, STORE_ENV: f"{host}:{port}"}
    spare_env = {**shared, SPARE_ENV: "1", WORLD_ENV: str(len(chosen) * plan.tasks_per_node)}
    spare_step = subprocess.Popen(
        launcher().step_command(cmd, spares, plan.tasks_per_node, keep_survivors=True, spares=True), env=spare_env
    )
    _announce(f"in-process recovery: rendezvous {host}:{port}, warm spare(s) on {','.join(spares)}")
    try:
        rc = step.run(launcher().step_command(cmd, chosen, plan.tasks_per_node, keep_survivors=True), shared)
    finally:
        _end(store)  # marks the end for spares still waiting
        try:
            spare_step.wait(timeout=_SPARE_EXIT_S)
        except subprocess.TimeoutExpired:
            spare_step.kill()
            spare_step.wait()
    reader.join(timeout=5)
    reported = [line.split()[1] for line in list(lines.queue) if line.startswith("done ")]
    if reported and reported[0].lstrip("-").isdigit() and int(reported[0]) != rc:
        _announce(f"{launcher().step_tool} exited with status {rc}; the training ended with {reported[0]}")
        return int(reported[0])
    return rc


def _end(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def next_attempt(data: dict[str, Any], job: JobFacts) -> int:
    """The number of the next attempt: after every attempt the ledger knows, and never below SLURM's restart count."""
    keys = [int(k) for k in data.get("attempts", {}) if str(k).isdigit()]
    return max([job.restart_count, *(k + 1 for k in keys)])


def loop(
    cmd: Sequence[str],
    run_dir: Path,
    spare: int,
    min_nodes: int,
    backoff: float,
    policy: restarts.RestartPolicy | None = None,
    in_process: bool = False,
) -> int:
    """Run the attempts of this job (see the module docstring); the batch script's exit status. ``policy`` is the
    config's fault.* when the loop was given the config; else the ledger's (rank 0 stores it) or the defaults.
    ``in_process`` (fault.in_process): each attempt's unused healthy nodes run warm spares (:func:`run_recoverable`)."""
    base = job_facts()
    plan = plan_from_env(os.environ, spare, min_nodes) if base.job_id else "not a batch job"
    if isinstance(plan, str):
        if base.job_id and spare:
            _announce(f"running the step unchanged: {plan}")
        return subprocess.run(list(cmd), check=False).returncode
    data = restarts.load_ledger(run_dir, base.job_id)
    try:  # the ledger records every attempt from here on; the trainer creates run.dir alike
        run_dir.mkdir(parents=True, exist_ok=True)
        restarts.save_ledger(run_dir, data)
    except OSError as e:  # another user's or a read-only run dir: the trainer refuses it in one line
        _announce(f"cannot write the restart ledger in {run_dir} ({e.strerror or e}): running the step once")
        return subprocess.run(list(cmd), check=False).returncode
    step = _Step()
    attempt = next_attempt(data, base)
    bad: set[str] = set(data.get("excluded", []))  # hosts this job excluded before (requeues) stay out
    bad |= set(data.get("gate_failed", {}))
    path = "requeue" if attempt > 0 else "first"
    restarted_in_job = 0
    while True:
        t_gate = time.time()
        candidates = [n for n in plan.allocated if n not in bad]
        verdicts = run_gate(candidates, run_dir=str(run_dir), gpus=plan.gpus_per_node)
        gate_s = time.time() - t_gate
        job = JobFacts(**{**base.__dict__, "restart_count": attempt})
        data = restarts.load_ledger(run_dir, base.job_id)
        for host, (ok, reasons) in verdicts.items():
            if not ok:
                bad.add(host)
                data.setdefault("gate_failed", {})[host] = reasons
                try:
                    record_unhealthy(run_dir, host, reasons, job=job)
                except OSError as e:  # failures.jsonl is a link, a FIFO, another user's: the verdict still holds
                    _announce(one_line(f"cannot record the health verdict: {e}", 300))
                _announce(
                    one_line(f"{host} failed the health gate: {'; '.join(reasons)}: not using it in this job", 2000)
                )
        chosen = choose_nodes(plan, bad)
        entry = data["attempts"].setdefault(str(attempt), {"restart": attempt})
        entry.update(path=path, gate_s=round(gate_s, 3), gate_start=t_gate)
        if chosen is None:
            restarts.save_ledger(run_dir, data)
            return _too_few(run_dir, plan, bad, job, policy)
        if step.stopping:  # cancelled or preempted during the gate: no new step
            restarts.save_ledger(run_dir, data)
            return 0
        entry.update(nodes=chosen, launched=time.time())
        restarts.save_ledger(run_dir, data)
        if len(chosen) < plan.train_nodes:
            _announce(
                f"continuing on {len(chosen)} of {plan.train_nodes} nodes (fault.min_nodes={plan.min_nodes}): "
                "fewer data-parallel replicas, the same global batch"
            )
        _announce(
            one_line(
                f"attempt {attempt} ({path}) on {','.join(chosen)}"
                + (f", excluded {','.join(sorted(bad))}" if bad else ""),
                2000,
            )
        )
        env = {**os.environ, ATTEMPT_ENV: str(attempt)}
        spares = [n for n in plan.allocated if n not in bad and n not in chosen] if in_process else []
        if spares:
            rc = run_recoverable(step, cmd, plan, chosen, spares, env)
        else:
            rc = step.run(step_for(cmd, plan, chosen), env)
        ended = time.time()
        data = restarts.load_ledger(run_dir, base.job_id)
        entry = data["attempts"].setdefault(str(attempt), {"restart": attempt})
        entry["step_end"] = ended
        if step.stopped_at is not None:  # cancelled, preempted or requeued: nothing else marks its time
            entry["stopped_at"] = step.stopped_at
        restarts.save_ledger(run_dir, data)
        _announce(f"{launcher().step_tool} exited with status {rc}")
        if rc == 0:
            return rc
        if step.stopping:  # cancelled, preempted, or rank 0's time-limit requeue: never restart what was stopped
            return 0 if data["attempts"][str(attempt)].get("requeued") else rc
        if data["attempts"][str(attempt)].get("requeued"):
            _announce(f"{launcher().step_tool} exited with {rc} after job {job.job_id} was requeued: nothing to decide")
            return 0
        d = restarts.decide_failure(run_dir, rc, policy, job)
        if d.stop:
            return rc
        bad |= set(d.blamed_hosts)
        if choose_nodes(plan, bad) is None:
            _announce(f"{len(plan.allocated) - len(bad)} usable node(s) left, {plan.min_nodes} needed: requeueing")
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            return restarts.requeue_after_failure(run_dir, d, job, exit_code=rc, bad_hosts=sorted(bad))
        wait = min(_MAX_BACKOFF_S, backoff * 2 ** max(0, d.streak - 1))
        d.entry.update(restarted="in-job", decided=time.time(), excluded=sorted(bad))
        restarts.save_ledger(run_dir, d.data)
        restarted_in_job += 1
        _announce(
            f"restarting in the allocation in {wait:.1f} s (in-job restart {restarted_in_job}, "
            f"restart {d.done + 1} of {d.policy.max_failures} after a failure)"
        )
        time.sleep(wait)
        if step.stopping:
            return rc
        attempt += 1
        path = "in-job"


def _too_few(
    run_dir: Path, plan: AttemptPlan, bad: set[str], job: JobFacts, policy: restarts.RestartPolicy | None
) -> int:
    """Before any step of this attempt: fewer healthy nodes than fault.min_nodes. Requeue without the bad ones."""
    msg = (
        f"{len(plan.allocated) - len(bad)} healthy node(s) of {len(plan.allocated)} allocated, "
        f"{plan.min_nodes} needed ({','.join(sorted(bad))} out)"
    )
    _announce(one_line(msg + ": requeueing", 2000))
    # kind "nodes", not "health": that one is a node's own gate verdict, and this is the job's
    try:
        record(run_dir, kind="nodes", cause=f"too few healthy nodes: {msg}", job=job)
    except OSError as e:  # failures.jsonl is a link, a FIFO, another user's: the requeue decision does not need it
        _announce(one_line(f"cannot record the failure: {e}", 300))
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    d = restarts.decide_failure(run_dir, 1, policy, job)
    if d.stop:
        return 1
    return restarts.requeue_after_failure(run_dir, d, job, exit_code=1, bad_hosts=sorted(bad))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        tool = launcher().step_tool
        print(f"usage: python -m hpcdist.launch.attempts [--run-dir DIR | CONFIG ...] -- {tool} ...", file=sys.stderr)
        return 2
    i = argv.index("--")
    ours, cmd = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(prog="python -m hpcdist.launch.attempts", description=__doc__.splitlines()[0])
    p.add_argument("--run-dir")
    p.add_argument("--spare-nodes", type=int)
    p.add_argument("--min-nodes", type=int)
    p.add_argument("--restart-backoff-s", type=float)
    p.add_argument("--in-process", action="store_true", help="fault.in_process: warm spares on the unused nodes")
    p.add_argument("config", nargs="*", help="CONFIG [section.key=value ...], as given to hpcdist train")
    args = p.parse_args(ours)
    if not cmd:
        p.error("no command after --")
    spare, min_nodes, backoff, policy, in_process = 0, 0, 3.0, None, args.in_process
    if args.config:
        from hpcdist import config as config_mod

        try:
            cfg = config_mod.load(args.config[0], list(args.config[1:]))
        except ValueError as e:  # the trainer refuses the same config with the same message: let it say so
            _announce(f"config: {e}")
            return subprocess.run(cmd, check=False).returncode
        run_dir = Path(cfg.run.dir)
        spare, min_nodes, backoff = cfg.fault.spare_nodes, cfg.fault.min_nodes, cfg.fault.restart_backoff_s
        policy = restarts.RestartPolicy.from_fault(cfg.fault)
        in_process = in_process or cfg.fault.in_process
    elif args.run_dir:
        run_dir = Path(args.run_dir)
    else:
        p.error("needs --run-dir or CONFIG")
    spare = args.spare_nodes if args.spare_nodes is not None else spare
    min_nodes = args.min_nodes if args.min_nodes is not None else min_nodes
    backoff = args.restart_backoff_s if args.restart_backoff_s is not None else backoff
    if spare < 0 or min_nodes < 0 or not backoff >= 0:
        p.error("--spare-nodes, --min-nodes and --restart-backoff-s must be >= 0")
    return loop(cmd, run_dir, spare, min_nodes, backoff, policy, in_process=in_process)


if __name__ == "__main__":
    sys.exit(main())
