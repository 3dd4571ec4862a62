"""The restart policy: whether a batch job comes back after it stopped, and on which nodes.

``restarts.json`` in <run.dir>: the restart ledger of the current batch job: one entry per attempt (restart number)
saying how it ended and whether hpcdist requeued it, the excluded nodes, the policy (fault.*), and why requeueing
stopped. A new job id starts a new ledger (a resubmission gets the full budget again). What failed and where is in
failures.jsonl (hpcdist.fault.failures).

Restart policy, three separate budgets:
    time limit   the requeue signal -> checkpoint -> the trainer returns -> :func:`after_stop`: rank 0 requeues
                 (hpcdist.launch.requeue); fault.max_restarts
    failure      the step failed -> the batch script runs ``python -m hpcdist.launch.restarts after-step``, which
                 attributes the failure, excludes the host (fault.exclude_failed_nodes, within limits that keep the
                 job schedulable) and requeues, unless fault.max_failures is spent or the same failure happened
                 fault.max_same_failure times in a row (a failure loop): then it says why and the job ends FAILED
    preemption   the scheduler requeued the job by itself (preemption, node failure, admin): counted when the next
                 attempt starts (:func:`begin_attempt`); beyond fault.max_preemptions (-1 = unlimited) that attempt
                 stops before training
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from hpcdist.base.atomic import atomic_write, read_bounded
from hpcdist.base.logging_utils import get_logger
from hpcdist.base.rundir import RunDir
from hpcdist.base.untrusted import DamagedRecord, one_line, read_json
from hpcdist.fault.failures import failure_record, primary_failure, read_failures, record
from hpcdist.fault.goodput import mark_attempt_end
from hpcdist.fault.stop import StopReason, signal_number
from hpcdist.launch.requeue import requeue
from hpcdist.schedulers import JobFacts, job_facts, launcher

__all__ = [
    "FailureDecision",
    "RestartPolicy",
    "after_step",
    "after_stop",
    "begin_attempt",
    "decide_failure",
    "in_job_restarts",
    "plan_exclusion",
    "requeue_after_failure",
]

log = get_logger(__name__)


# ------------------------------------------------------------------------------------------------ ledger


@dataclass(frozen=True)
class RestartPolicy:
    """fault.* as the requeue decisions read it (also stored in the ledger for after-step without a config)."""

    requeue: bool
    max_time_limit: int
    max_preemptions: int
    max_failures: int
    max_same_failure: int
    exclude_failed_nodes: bool
    max_excluded_nodes: int
    exclude_nodes_file: str | None

    @classmethod
    def from_fault(cls, fault: Any) -> RestartPolicy:
        return cls(
            requeue=fault.requeue,
            max_time_limit=fault.max_restarts,
            max_preemptions=fault.max_preemptions,
            max_failures=fault.max_failures,
            max_same_failure=fault.max_same_failure,
            exclude_failed_nodes=fault.exclude_failed_nodes,
            max_excluded_nodes=fault.max_excluded_nodes,
            exclude_nodes_file=fault.exclude_nodes_file,
        )

    @classmethod
    def from_record(cls, value: Any) -> RestartPolicy | None:
        """The policy a ledger stored (``asdict`` of one), or None when ``value`` is not exactly that: every field
        present, of its type (a budget of "3" would fail the first comparison), nothing else."""
        if not isinstance(value, dict) or set(value) != {f.name for f in fields(cls)}:
            return None
        for f in fields(cls):
            v = value[f.name]
            if f.type == "bool":
                ok = isinstance(v, bool)
            elif f.type == "int":
                ok = isinstance(v, int) and not isinstance(v, bool) and abs(v) < 1 << 31
            else:  # "str | None"
                ok = v is None or isinstance(v, str)
            if not ok:
                return None
        return cls(**value)

    @classmethod
    def defaults(cls) -> RestartPolicy:
        from hpcdist.config import FaultConfig  # imports torch: only where no config and no ledger is at hand

        return cls.from_fault(FaultConfig())


_LEDGER_MAX_BYTES = 16 << 20  # one short entry per attempt: thousands of attempts
_EXCLUDE_FILE_MAX_BYTES = 1 << 20  # fault.exclude_nodes_file: host names, tens of thousands of them
_ATTEMPT_KEY = re.compile(r"0|[1-9][0-9]{0,8}")  # str(restart): ASCII digits, no "²", no 5,000-digit numbers
_REQUEUED = ("time_limit", "failure")  # what an attempt's "requeued" can say; anything else is no requeue


def load_ledger(run_dir: str | os.PathLike[str], job_id: str | None) -> dict[str, Any]:
    """The ledger of ``job_id``; a fresh one when the file is missing, damaged, or belongs to another job.

    Read as a record someone else could have written (hpcdist.base.untrusted): every field the restart policy decides
    by is checked here, once, and a value of the wrong type is dropped, so a damaged ledger can neither crash the
    attempt loop or after-step nor make a failed attempt look requeued."""
    try:
        data = read_json(RunDir(run_dir).restarts, _LEDGER_MAX_BYTES)
    except DamagedRecord as e:
        log.warning("%s: starting a new restart ledger", one_line(e, 300))
        data = None
    if not isinstance(data, dict) or data.get("job_id") != job_id or not isinstance(data.get("attempts"), dict):
        data = {"job_id": job_id, "attempts": {}, "excluded": [], "stopped": None, "policy": None}
    # the attempt loop reads these back as host names: anything else in them is dropped, not trusted
    data["excluded"] = _hosts(data.get("excluded"))
    gate = data.get("gate_failed")
    if gate is not None:
        gate = gate if isinstance(gate, dict) else {}
        data["gate_failed"] = {h: [str(x) for x in r] for h, r in gate.items() if isinstance(r, list)}
    data["stopped"] = data.get("stopped") or None
    data["attempts"] = {
        k: _attempt_entry(a) for k, a in data["attempts"].items() if _ATTEMPT_KEY.fullmatch(k) and isinstance(a, dict)
    }
    stopped = data.get("stopped")
    if stopped and not (isinstance(stopped, dict) and isinstance(stopped.get("reason"), str)):
        # a stop the policy cannot name is still a stop: requeueing was refused once, it stays refused
        data["stopped"] = {"reason": "the ledger records a stop it does not explain (restarts.json)"}
    if data.get("policy") is not None and RestartPolicy.from_record(data["policy"]) is None:
        log.warning("%s: its fault.* policy is not one; using the config's or the defaults", RunDir(run_dir).restarts)
        data["policy"] = None
    return data


def _hosts(value: Any) -> list[str]:
    return [h for h in value if isinstance(h, str)] if isinstance(value, list) else []


def _attempt_entry(a: dict[str, Any]) -> dict[str, Any]:
    """An attempt's entry with the fields the policy counts by made what they can be: ``requeued`` one of
    _REQUEUED or None (a NaN or a ``1`` there is no requeue: counting it one would end a failed job COMPLETED),
    ``restarted`` "in-job" or None, the strings strings, the host lists lists of strings."""
    out = dict(a)
    if "requeued" in a:
        out["requeued"] = a["requeued"] if a["requeued"] in _REQUEUED else None
    if "restarted" in a:
        out["restarted"] = "in-job" if a["restarted"] == "in-job" else None
    for key in ("ended", "signature", "cause", "path", "host"):
        if key in out and not isinstance(out[key], str):
            del out[key]
    for key in ("nodes", "excluded"):
        if key in out:
            out[key] = _hosts(out[key])
    return out


def save_ledger(run_dir: str | os.PathLike[str], data: Mapping[str, Any]) -> None:
    atomic_write(RunDir(run_dir).restarts, json.dumps(data, indent=1, sort_keys=True))


def _attempt_record(data: dict[str, Any], restart: int) -> dict[str, Any]:
    return data["attempts"].setdefault(str(restart), {"restart": restart})


def requeues(data: Mapping[str, Any], reason: str, *, before: int | None = None) -> int:
    """How many attempts (restarts < ``before``, if given) hpcdist requeued for ``reason`` (time_limit | failure)."""
    return sum(
        1 for k, a in data["attempts"].items() if a.get("requeued") == reason and (before is None or int(k) < before)
    )


def preemptions(data: Mapping[str, Any], restart: int) -> int:
    """Restarts 1..restart that SLURM made by itself: the attempt before each was not requeued by hpcdist.

    Reads only attempts before ``restart``, so every rank computes the same number whether or not rank 0 has
    already written this attempt's entry.
    """
    attempts = data["attempts"]
    return sum(
        1
        for k in range(1, restart + 1)
        if not (attempts.get(str(k - 1), {}).get("requeued") or attempts.get(str(k - 1), {}).get("restarted"))
    )


def failure_streak(data: Mapping[str, Any], restart: int, sig: str) -> int:
    """Consecutive attempts up to ``restart`` (included) that ended in a failure with signature ``sig``."""
    n = 0
    for k in range(restart, -1, -1):
        a = data["attempts"].get(str(k), {})
        if a.get("ended") != "failure" or a.get("signature") != sig:
            break
        n += 1
    return n


def begin_attempt(run_dir: str | os.PathLike[str], policy: RestartPolicy, job: JobFacts, *, write: bool) -> str | None:
    """At the start of an attempt (every rank, before the process group): a reason to stop, or None to train.

    ``write`` (rank 0) registers the attempt and the policy in the ledger. The preemption count reads only earlier
    attempts, so all ranks reach the same decision.
    """
    if job.job_id is None:
        return None  # not a SLURM job: nothing restarts it
    data = load_ledger(run_dir, job.job_id)
    n = preemptions(data, job.restart_count)
    reason = None
    if policy.max_preemptions >= 0 and n > policy.max_preemptions:
        reason = (
            f"job {job.job_id} came back from {n} restart(s) SLURM made by itself (preemption, node failure) "
            f"and fault.max_preemptions={policy.max_preemptions}: not training again; resubmit to continue"
        )
    if write:
        entry = _attempt_record(data, job.restart_count)
        entry.update(start=time.time(), host=socket.gethostname(), preemptions=n)
        data["policy"] = asdict(policy)
        if reason:
            entry.update(ended="stopped")
            data["stopped"] = {"time": time.time(), "restart": job.restart_count, "reason": reason}
        save_ledger(run_dir, data)
    return reason


def time_limit_decision(run_dir: str | os.PathLike[str] | None, max_time_limit: int, job: JobFacts) -> str | None:
    """Before a time-limit requeue (every rank, same answer): a reason not to requeue, or None.

    Counted in the ledger (time-limit requeues only; earlier attempts only, so ranks reading before or after rank 0
    marked this one agree); without a run dir, the job's restart count (all restarts)."""
    data = load_ledger(run_dir, job.job_id) if run_dir is not None else None
    count = requeues(data, "time_limit", before=job.restart_count) if data is not None else job.restart_count
    if count >= max_time_limit:
        return (
            f"job {job.job_id} was already requeued {count} time(s) at its time limit (fault.max_restarts="
            f"{max_time_limit}): not requeueing again; resubmit to continue from the checkpoint"
        )
    return None


def mark_time_limit(run_dir: str | os.PathLike[str], job: JobFacts, *, reason: str | None) -> list[str]:
    """Rank 0, before the time-limit requeue (``reason`` None) or instead of it: record how this attempt ended.
    Returns the nodes the requeued job must avoid (earlier exclusions plus fault.exclude_nodes_file)."""
    data = load_ledger(run_dir, job.job_id)
    entry = _attempt_record(data, job.restart_count)
    entry.update(ended="time_limit", end=time.time(), requeued=None if reason else "time_limit")
    excluded = list(data.get("excluded", []))
    if reason:
        data["stopped"] = {"time": time.time(), "restart": job.restart_count, "reason": reason}
    elif data.get("policy"):
        excluded = _exclusions(
            data, RestartPolicy.from_record(data["policy"]) or RestartPolicy.defaults(), job, blamed_hosts=[]
        )
    save_ledger(run_dir, data)
    return excluded


def _exclusions(
    data: dict[str, Any], policy: RestartPolicy, job: JobFacts, *, blamed_hosts: Sequence[str]
) -> list[str]:
    """The job's excluded nodes after adding ``blamed_hosts`` and fault.exclude_nodes_file, within the limits;
    stored in the ledger (``data``, saved by the caller)."""
    candidates = list(blamed_hosts) if policy.exclude_failed_nodes else []
    if policy.exclude_nodes_file:
        try:
            # the user's file, but never a FIFO (a hang), a link's target or a huge file read whole
            text = read_bounded(policy.exclude_nodes_file, _EXCLUDE_FILE_MAX_BYTES).decode("utf-8", "replace")
            candidates += parse_hosts(text)
        except (OSError, ValueError) as e:
            _say(one_line(f"fault.exclude_nodes_file {policy.exclude_nodes_file}: {e}", 400))
    excluded = list(data.get("excluded", []))
    if candidates:
        excluded, notes = plan_exclusion(
            excluded,
            candidates,
            max_excluded=policy.max_excluded_nodes,
            job_nodes=job.num_nodes or 1,
            usable=usable_nodes(job.partition),
        )
        for note in notes:
            _say(one_line(note, 500))
    data["excluded"] = excluded
    return excluded


def after_stop(
    reason: StopReason,
    *,
    rank: int,
    requeue_signal: str = "USR2",
    requeue_enabled: bool = True,
    max_restarts: int = 10,
    run_dir: str | os.PathLike[str] | None = None,
    job: JobFacts | None = None,
) -> int:
    """Every rank, once the stop checkpoint is complete: requeue (rank 0) or exit. Returns the exit code.

    ``run_dir`` holds the restart ledger (time-limit requeues are counted there, apart from preemptions and
    failures); ``max_restarts`` is fault.max_restarts."""
    job = job if job is not None else job_facts()
    if not job.job_id:
        # nothing will continue the run: the shell's convention for a process ended by that signal (130 / 143 /
        # 140 for USR2), never 0, which a wrapper would take for a finished run
        if reason == StopReason.TIME_LIMIT:
            log.info(
                "stopped by %s outside SLURM (exit %d); rerun with checkpoint.resume=auto to continue",
                signal_number(requeue_signal).name,
                reason.exit_code(requeue_signal),
            )
        return reason.exit_code(requeue_signal)
    if reason != StopReason.TIME_LIMIT:
        # under SLURM the job is being cancelled or preempted: a non-zero status would make the batch script's
        # failure policy (after-step) treat it as a failure and requeue it
        log.info("stopping on %s after a complete checkpoint; not requeueing", reason.signal_name)
        return 0
    if not requeue_enabled:
        log.info("fault.requeue is off: job %s ends here; resubmit to continue", job.job_id)
        return 0
    refused = time_limit_decision(run_dir, max_restarts, job)
    if refused:
        log.error("%s", refused)
    exclude: list[str] = []
    if rank == 0 and run_dir is not None:
        # recorded before the requeue: SLURM ends this process right after it
        exclude = mark_time_limit(run_dir, job, reason=refused)
    if refused:
        return 3
    if rank == 0:
        return requeue(job.job_id, exclude=exclude)
    return 0


# ------------------------------------------------------------------------------------------------ exclusion


def parse_hosts(text: str) -> list[str]:
    """Host names from a file's text: one per line, comma- or blank-separated, SLURM hostlists (node[1-3]), or the
    ``--exclude=a,b`` / ``suggested: --exclude=...`` line the nccl_check finder prints. ``#`` starts a comment."""
    hosts: list[str] = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if "--exclude=" in line:
            words = line.split("--exclude=", 1)[1].split()
            line = words[0] if words else ""
        if not line:
            continue
        for name in launcher().expand_nodes(line):
            if name not in hosts:
                hosts.append(name)
    return hosts


def usable_nodes(partition: str | None) -> list[str] | None:
    """Nodes of the partition that can run jobs (not down, drained, failed or unresponsive); None if unknown."""
    return launcher().usable_nodes(partition)


def plan_exclusion(
    excluded: Sequence[str],
    candidates: Sequence[str],
    *,
    max_excluded: int,
    job_nodes: int,
    usable: Sequence[str] | None,
) -> tuple[list[str], list[str]]:
    """(new excluded list, one note per candidate not added). Never more than ``max_excluded`` nodes, and never so
    many that fewer than ``job_nodes`` usable nodes stay outside the list: the job must stay schedulable."""
    out = list(excluded)
    notes = []
    for host in candidates:
        if host in out:
            continue
        if len(out) + 1 > max_excluded:
            notes.append(
                f"not excluding {host}: {len(out)} node(s) excluded already (fault.max_excluded_nodes={max_excluded})"
            )
            continue
        if usable is not None:
            left = [n for n in usable if n not in out and n != host]
            if len(left) < job_nodes:
                notes.append(
                    f"not excluding {host}: the partition would keep {len(left)} usable node(s) for a "
                    f"{job_nodes}-node job"
                )
                continue
        out.append(host)
    return out, notes


# ------------------------------------------------------------------------------------------------ after-step


def _say(msg: str) -> None:
    # the batch script's stdout is the job log; flush before the requeue makes the scheduler end this script
    print(f"[hpcdist after-step {time.strftime('%H:%M:%S')}] {msg}", flush=True)


@dataclass
class FailureDecision:
    """What the failure policy concluded about a failed attempt (:func:`decide_failure`): ``stop`` is the reason not
    to train again (None: restart, in the allocation or by a requeue); ``blamed_hosts`` the hosts it blames."""

    data: dict[str, Any]
    entry: dict[str, Any]
    primary: Mapping[str, Any]
    blamed_hosts: list[str]
    streak: int
    done: int
    policy: RestartPolicy
    stop: str | None


def decide_failure(
    run_dir: str | os.PathLike[str], exit_code: int, policy: RestartPolicy | None, job: JobFacts
) -> FailureDecision:
    """Attribute a failed attempt (failures.jsonl, or an ``exit`` record when no rank said why), record it in the
    ledger and apply the budgets: fault.max_failures (restarts after a failure, in-job ones included) and
    fault.max_same_failure (a failure loop). The one failure policy of both paths, in-job restart and requeue."""
    run_dir = Path(run_dir)
    data = load_ledger(run_dir, job.job_id)
    if policy is None:
        policy = RestartPolicy.from_record(data.get("policy")) or RestartPolicy.defaults()
    try:
        records = read_failures(run_dir, job_id=job.job_id, restart=job.restart_count)
    except DamagedRecord as e:  # a link, a FIFO: what the ranks said is lost, the policy still decides
        _say(f"{one_line(e, 300)}: no rank's failure record can be read")
        records = []
    primary = primary_failure(records)
    if primary is None:
        cause = f"the training step exited with status {exit_code} and no rank recorded a cause (see the job log)"
        try:
            primary = record(run_dir, kind="exit", cause=cause, job=job)
        except OSError as e:  # failures.jsonl is a link, a FIFO, another user's: decided without the record
            _say(one_line(f"cannot record the failure: {e}", 300))
            primary = failure_record(kind="exit", cause=cause, job=job)
    sig = primary["signature"]
    blamed = [b for b in primary.get("blame", []) if b.get("host")]
    who = ", ".join(f"rank {b.get('rank')} on {b['host']}" for b in blamed) or "no rank in particular"
    _say(one_line(f"step failed (exit {exit_code}): {primary['kind']}: {primary['cause']} [{who}]", 1000))

    entry = _attempt_record(data, job.restart_count)
    entry.update(
        ended="failure",
        end=time.time(),
        failed_at=primary.get("time"),
        signature=sig,
        cause=primary["cause"],
        blame=blamed,
        requeued=None,
    )
    streak = failure_streak(data, job.restart_count, sig)
    done = requeues(data, "failure") + in_job_restarts(data)
    reason = None
    if job.job_id is None:
        reason = "not a SLURM job"
    elif data.get("stopped"):
        reason = f"requeueing stopped earlier: {data['stopped']['reason']}"
    elif not policy.requeue:
        reason = "fault.requeue is off"
    elif done >= policy.max_failures:
        reason = f"{done} restart(s) after a failure already (fault.max_failures={policy.max_failures})"
    elif streak >= policy.max_same_failure:
        reason = (
            f"failure loop: the same failure happened {streak} time(s) in a row (fault.max_same_failure="
            f"{policy.max_same_failure}): {sig}; restarting will not fix it"
        )
    if reason:
        data["stopped"] = data.get("stopped") or {"time": time.time(), "restart": job.restart_count, "reason": reason}
        save_ledger(run_dir, data)
        _say(one_line(f"not restarting job {job.job_id}: {reason}; see {RunDir(run_dir).failures}", 1000))
        _mark_goodput_end(run_dir)
    hosts = [b["host"] for b in blamed] if policy.exclude_failed_nodes else []
    return FailureDecision(data, entry, primary, hosts, streak, done, policy, reason)


def in_job_restarts(data: Mapping[str, Any]) -> int:
    """How many attempts of this job ended in a failure that hpcdist.launch.attempts restarted in the allocation."""
    return sum(1 for a in data["attempts"].values() if a.get("restarted") == "in-job")


def requeue_after_failure(
    run_dir: str | os.PathLike[str], d: FailureDecision, job: JobFacts, *, exit_code: int, bad_hosts: Sequence[str] = ()
) -> int:
    """Requeue the job after the failure ``d`` (not stopped), excluding its blamed hosts and ``bad_hosts`` (failed the
    health gate) within the limits. 0 when requeued, else ``exit_code``."""
    run_dir = Path(run_dir)
    data, entry = d.data, d.entry
    blamed = list(dict.fromkeys([*d.blamed_hosts, *bad_hosts]))
    excluded = _exclusions(data, d.policy, job, blamed_hosts=blamed)
    entry.update(requeued="failure", excluded=excluded, decided=time.time())
    save_ledger(run_dir, data)  # before the requeue: SLURM may end this script right after it
    _mark_goodput_end(run_dir)
    _say(
        one_line(
            f"requeueing job {job.job_id} (restart {d.done + 1} of {d.policy.max_failures} after a failure, this "
            f"failure {d.streak} time(s) in a row)" + (f", excluding {','.join(excluded)}" if excluded else ""),
            2000,
        )
    )
    rc = requeue(str(job.job_id), exclude=excluded)
    if rc != 0:
        entry.update(requeued=None)  # requeue() said why; a later failure may try again
        save_ledger(run_dir, data)
        return exit_code
    return 0


def after_step(run_dir: str | os.PathLike[str], exit_code: int, policy: RestartPolicy | None, job: JobFacts) -> int:
    """Decide, after the training step failed, whether the job is requeued. Returns the batch script's exit code:
    0 after a requeue (SLURM is ending this run anyway), else ``exit_code`` so the job ends FAILED."""
    if exit_code == 0:
        return 0
    # a requeue makes the scheduler send TERM to this batch script and its children: finish the ledger and the
    # ExcNodeList update first (SIGKILL follows only after KillWait)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    run_dir = Path(run_dir)
    data = load_ledger(run_dir, job.job_id)
    if data["attempts"].get(str(job.restart_count), {}).get("requeued"):
        # rank 0 requeued this attempt (time limit) and SLURM then ended the step while the ranks were exiting
        _say(f"{launcher().step_tool} exited with {exit_code} after job {job.job_id} was requeued: nothing to decide")
        return 0
    try:
        d = decide_failure(run_dir, exit_code, policy, job)
        if d.stop:
            return exit_code
        return requeue_after_failure(run_dir, d, job, exit_code=exit_code)
    except OSError as e:  # restarts.json is a directory, the run dir read-only: no budget can be counted
        _say(one_line(f"cannot write the restart ledger ({e}): not requeueing; the job ends FAILED", 500))
        return exit_code


def _mark_goodput_end(run_dir: Path) -> None:
    try:
        mark_attempt_end(run_dir)
    except (OSError, ValueError) as e:
        _say(f"goodput: {e}")


def _run_dir_and_policy(config_args: Sequence[str]) -> tuple[Path, RestartPolicy]:
    from hpcdist import config as config_mod

    cfg = config_mod.load(config_args[0], list(config_args[1:]))
    return Path(cfg.run.dir), RestartPolicy.from_fault(cfg.fault)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m hpcdist.launch.restarts",
        description="Batch-script side of the failure policy (see this module's docstring).",
    )
    sub = p.add_subparsers(dest="command", required=True)
    tool = launcher().step_tool
    a = sub.add_parser("after-step", help=f"after {tool}: record, exclude, requeue or stop; exit status for the script")
    a.add_argument("--exit-code", type=int, required=True, help=f"{tool}'s exit status")
    a.add_argument("--run-dir", help="the run directory (instead of CONFIG)")
    a.add_argument("config", nargs="*", help="CONFIG [section.key=value ...], as given to hpcdist train")
    args = p.parse_args(argv)
    if args.exit_code == 0:
        return 0
    job = job_facts()
    if args.run_dir:
        run_dir, policy = Path(args.run_dir), None
    elif args.config:
        try:
            run_dir, policy = _run_dir_and_policy(args.config)
        except ValueError as e:  # ConfigError: the trainer failed on the same config; nothing to requeue
            _say(f"config: {e}")
            return args.exit_code
    else:
        p.error("after-step needs --run-dir or CONFIG")
    from hpcdist.base.logging_utils import setup_logging

    setup_logging(0)
    return after_step(run_dir, args.exit_code, policy, job)


if __name__ == "__main__":
    sys.exit(main())
