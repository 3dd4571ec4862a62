"""Requeue benchmark: how long a preempted hpcdist job is away, against what SLURM itself takes to requeue a job.

Goal (issue): hpcdist's own share of a requeue is <= 20 s. That share cannot be timed directly, because most of
the time between the warning signal and the first resumed step belongs to SLURM (killing the job, the
BeginTime hold it puts on every requeued job, scheduling it again), so it is measured as a difference, both
terms in the same invocation on the same sandbox:

1. **Bare job** (SLURM's own requeue delay). ``sbatch --requeue --wrap`` a job that appends ``date +%s.%N`` to a
   file when it starts, then sleeps. Once it runs, ``scontrol requeue <id>``; the delay is the time from that
   call to the second line in the file, i.e. to the job script starting again. Nothing of hpcdist is involved.
2. **hpcdist job**. ``sbatch sbatch/train.sh configs/demo.yaml`` with the tiny-model overrides of
   tests/slurm/test_train_slurm.py (``tiny_overrides``: a 2-layer dim-64 model, every step logged, no periodic
   checkpoints), 2 tasks (``--ntasks-per-node=2 --gpus-per-node=2 --cpus-per-task=1``),
   ``HPCDIST_NCCL_PROFILE=ethernet``, 100000 steps (it is cancelled once measured). When metrics.jsonl has a
   step >= 5, ``scancel --signal=USR2 --batch <id>`` (what ``--signal=B:USR2@300`` delivers before the time
   limit) at t0, then, from t0:

   - ``checkpoint COMPLETE``: the ``time`` recorded in the checkpoint's COMPLETE marker (the batch shell forwards
     USR2 through srun, the ranks agree at a step boundary, save one DCP checkpoint, write the marker);
   - ``requeued``: first poll that sees ``Restarts=1`` (rank 0 has run ``scontrol requeue``);
   - ``running again``: first poll that sees the job RUNNING with ``Restarts=1``;
   - ``first resumed step``: the ``time`` of the first metrics.jsonl record written after t0 for a step beyond
     the checkpoint's (batch script, srun, Python + torch import, process group, resume, one step).

   The last one is the total. ``hpcdist overhead = total - bare``: what the job spends on top of SLURM's own
   requeue (signal forwarding, agreement, checkpoint, ``scontrol requeue``, then srun, start-up, resume and one
   step), compared with the goal (20 s).

Both measurements run under two hold policies, and the overhead is taken within a policy:

- **hold kept** -- what a real cluster does: a requeued job stays PENDING (Reason=BeginTime) for
  cred_expire + 1 s, 31 s in the sandbox (``AuthInfo=cred_expire=30``, see tools/slurm_sandbox); 121 s with
  SLURM's default, which a real cluster adds to the bare delay and to the total alike, so the difference holds.
  BeginTime has one-second resolution and the scheduler runs every 2 s here, so this difference carries up to
  ~2-3 s of jitter either way.
- **hold released** -- what the tests do: ``release_requeue_hold`` (tests/slurm/conftest.py) sets
  ``StartTime=now`` once the clock has left the second of the requeue. The difference is less noisy here.

Polled events (``requeued``, ``running again``) are seen within ~0.1 s plus one ``scontrol`` call; the start of
the bare job, the COMPLETE marker and the resumed step carry timestamps written by the job itself. The model is
tiny, so the checkpoint takes well under a second; a large model adds its DCP write time (logged by the trainer
as ``save_seconds`` in the marker) to the overhead.

The benchmark starts its own one-node sandbox (``tools/slurm_sandbox start --nodes 1 --dir DIR``, default
/tmp/hpcdist-bench-slurm) and stops it at the end, also after an error or Ctrl-C (``--keep-sandbox`` leaves it
running). It takes /tmp/hpcdist-slurm-tests.lock first, the lock the SLURM test fixtures hold for a whole
session: both use the node name node1, the same /etc/hosts entries and the same slurm ports, so it waits for a
running ``pytest tests/slurm`` to finish instead of breaking it. Needs root, slurm-wlm and munge, and the test
extra (it imports the SLURM helpers of tests/slurm). Run from the repository root::

    python tools/bench/requeue.py                    # ~1.5 min on an idle 2-core CPU
    python tools/bench/requeue.py --repeats 3        # medians (min-max) of 3 rounds
    python tools/bench/requeue.py --keep-sandbox --json runs/bench/my.json

It prints one table and writes every number (the raw timestamps of every event included) to ``--json`` (default
runs/bench/requeue.json). The goal is reported, never enforced; the script exits 1 only when a measurement
could not be taken (a job failed, did not resume where it checkpointed, or timed out).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # `python tools/bench/requeue.py` puts only tools/bench on sys.path
    sys.path.insert(0, str(REPO))

# tests.slurm.conftest owns the lock path; importing it costs pytest, not torch
from tests.slurm.conftest import LOCK_PATH as _LOCK_PATH  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=1, help="rounds of all four measurements (default 1)")
    p.add_argument("--keep-sandbox", action="store_true", help="leave the sandbox running at the end")
    p.add_argument("--dir", default="/tmp/hpcdist-bench-slurm", help="sandbox directory (default %(default)s)")
    p.add_argument("--timeout", type=float, default=240, help="seconds a requeue may take before it is an error")
    p.add_argument("--lock-timeout", type=float, default=1800, help=f"seconds to wait for {_LOCK_PATH}")
    p.add_argument("--json", default="runs/bench/requeue.json", help="where to write all numbers")
    return p


if __name__ == "__main__":
    # --help and a bad flag answer here, before torch (and hpcdist's trainer) is imported: seconds on a
    # busy node. main() parses again; that costs nothing.
    build_parser().parse_args()


from hpcdist.data import prepare_shards, stdlib_corpus  # noqa: E402
from tests.slurm.conftest import (  # noqa: E402
    FINAL_STATES,
    SANDBOX,
    Cluster,
    _cluster_env,
    _machine_lock,
    job_info,
    release_requeue_hold,
    run_cmd,
    wait_job,
)
from tests.slurm.test_train_slurm import JOB_ENV, tiny_overrides  # noqa: E402
from tools.bench.overhead import table  # noqa: E402

GOAL_S = 20.0
POLICIES = ("kept", "released")
POLICY_TITLES = {"kept": "hold kept", "released": "hold released"}
POLL_S = 0.1
SIGNAL_AT_STEP = 5
TRAIN_STEPS = 100_000  # never reached: the job is cancelled once its first resumed step is logged
TASK_ARGS = ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=2", "--cpus-per-task=1"]
CORPUS_TOKENS = 200_000  # as the tests' corpus_dir fixture


# ------------------------------------------------------------------------------------------------- helpers


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def tail_text(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return f"({path}: missing)"


def sandbox(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SANDBOX), *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def start_sandbox(d: Path) -> Cluster:
    if (d / "state.json").exists():  # ours: a --keep-sandbox run or an interrupted one left it
        sandbox("stop", "--dir", str(d))
    t0 = time.perf_counter()
    proc = sandbox("start", "--nodes", "1", "--dir", str(d), "--json")
    if proc.returncode != 0:
        raise RuntimeError(f"slurm_sandbox start --nodes 1 --dir {d} failed ({proc.returncode}):\n{proc.stderr}")
    info = json.loads(proc.stdout)
    log(f"sandbox up in {time.perf_counter() - t0:.1f} s: {info['slurm_conf']}")
    return Cluster(
        dir=Path(info["dir"]),
        slurm_conf=Path(info["slurm_conf"]),
        nodes=info["nodes"],
        partition=info["partition"],
        controller=info["controller"],
        env={**_cluster_env(), "SLURM_CONF": info["slurm_conf"]},  # the tests' job environment
    )


def stop_sandbox(d: Path) -> None:
    proc = sandbox("stop", "--dir", str(d), timeout=120)
    if proc.returncode != 0:
        print(f"slurm_sandbox stop --dir {d} failed:\n{proc.stderr}", file=sys.stderr)
    else:
        log(f"sandbox in {d} stopped")


def submit(cluster: Cluster, args: Sequence[str], *, cwd: Path, env: dict[str, str] | None = None) -> str:
    proc = run_cmd(cluster, "sbatch", "--parsable", *args, cwd=cwd, env=env or cluster.env)
    return proc.stdout.strip().split(";")[0]


def end_job(cluster: Cluster, job: str) -> None:
    """Cancel the job and wait until it has ended, so that it takes no CPU from the next measurement."""
    run_cmd(cluster, "scancel", job, check=False)
    try:
        wait_job(cluster, job, timeout=60)
    except TimeoutError:
        run_cmd(cluster, "scancel", "--signal=KILL", "--full", job, check=False)
        wait_job(cluster, job, timeout=60)


class Releaser:
    """Runs ``release_requeue_hold`` in a thread, so that the main thread keeps polling the job meanwhile."""

    def __init__(self, cluster: Cluster, job: str) -> None:
        self.error: str | None = None
        self.done_at: float | None = None
        self._thread = threading.Thread(target=self._run, args=(cluster, job), daemon=True)
        self._thread.start()

    def _run(self, cluster: Cluster, job: str) -> None:
        try:
            release_requeue_hold(cluster, job, timeout=120)
            self.done_at = time.time()
        except Exception:
            self.error = traceback.format_exc()

    def join(self) -> None:
        self._thread.join(timeout=130)
        if self.error:
            raise RuntimeError(f"release_requeue_hold failed:\n{self.error}")


@dataclass
class JobWatch:
    """First wall-clock time (time.time()) at which each state of a requeued job was seen by polling."""

    cluster: Cluster
    job: str
    events: dict[str, float] = field(default_factory=dict)
    last: dict[str, str] = field(default_factory=dict)

    def poll(self) -> dict[str, str]:
        now = time.time()
        info = job_info(self.cluster, self.job)
        self.last = info
        if int(info.get("Restarts", "0")) >= 1:
            self.events.setdefault("requeued", now)
            if info["JobState"] == "RUNNING":
                self.events.setdefault("running_again", now)
        return info


def wait_until(what: str, check: Callable[[], bool], timeout_s: float, on_timeout: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout_s:.0f} s\n{on_timeout()}")
        time.sleep(POLL_S)


class MetricsTail:
    """metrics.jsonl records appended since the last read (the file grows by one line per step)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.partial = path, 0, ""

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path) as f:
                f.seek(self.offset)
                chunk = f.read()
                self.offset = f.tell()
        except FileNotFoundError:
            return []
        lines = (self.partial + chunk).split("\n")
        self.partial = lines.pop()  # an unfinished last line waits for the next read
        records = [json.loads(line) for line in lines if line.strip()]
        return [r for r in records if "split" not in r]  # training steps only, not eval records


# ------------------------------------------------------------------------------------------------- bare job


def bench_bare(cluster: Cluster, d: Path, policy: str, timeout_s: float) -> dict[str, Any]:
    """`scontrol requeue` of a running sleep job -> its script starting again."""
    d.mkdir(parents=True)
    starts = d / "starts"
    wrap = f"date +%s.%N >> {starts}; exec sleep 3600"
    args = ["--requeue", f"--job-name=bench-bare-{policy}", f"--output={d / 'out.txt'}", "--open-mode=append"]
    job = submit(cluster, [*args, "--wrap", wrap], cwd=d)

    def stamps() -> list[float]:
        return [float(x) for x in starts.read_text().split()] if starts.exists() else []

    wait_until("bare job started", lambda: len(stamps()) >= 1, 120, lambda: json.dumps(job_info(cluster, job)))
    wait_job(cluster, job, timeout=60, states=("RUNNING",))
    time.sleep(1.0)  # let the first start settle (the sleep is running) before requeueing it
    watch = JobWatch(cluster, job)
    t0 = time.time()
    run_cmd(cluster, "scontrol", "requeue", job)
    returned = time.time()
    releaser = Releaser(cluster, job) if policy == "released" else None
    deadline = time.monotonic() + timeout_s
    while len(stamps()) < 2:
        info = watch.poll()
        if info["JobState"] in FINAL_STATES:
            raise RuntimeError(f"bare job {job} ended ({info['JobState']}) instead of starting again: {info}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"bare job {job} not started again {timeout_s:.0f} s after the requeue: {info}")
        time.sleep(POLL_S)
    second = stamps()[1]
    seen_until = time.monotonic() + 10  # RUNNING is seen right after the script's own timestamp, or before it
    while "running_again" not in watch.events and time.monotonic() < seen_until:
        watch.poll()
        time.sleep(POLL_S)
    if releaser is not None:
        releaser.join()
    end_job(cluster, job)
    rel = {k: v - t0 for k, v in watch.events.items()}
    return {
        "job": job,
        "t0": t0,
        "first_start": stamps()[0],
        "second_start": second,
        "scontrol_requeue_s": returned - t0,
        "requeued_s": rel.get("requeued"),
        "running_again_s": rel.get("running_again"),
        "delay_s": second - t0,
        "release_returned_s": releaser.done_at - t0 if releaser and releaser.done_at else None,
    }


# ------------------------------------------------------------------------------------------------- hpcdist job


def bench_hpcdist(cluster: Cluster, d: Path, corpus: Path, policy: str, timeout_s: float) -> dict[str, Any]:
    """USR2 to a training job -> checkpoint -> requeue -> its first resumed step."""
    run_dir, out = d / "run", d / "out.txt"
    d.mkdir(parents=True)
    env = {**cluster.env, **JOB_ENV}
    args = [*TASK_ARGS, f"--job-name=bench-hpcdist-{policy}", f"--output={out}"]
    overrides = tiny_overrides(run_dir, corpus, TRAIN_STEPS)
    submitted = time.time()
    job = submit(
        cluster, [*args, str(REPO / "sbatch" / "train.sh"), "configs/demo.yaml", *overrides], cwd=REPO, env=env
    )
    metrics = MetricsTail(run_dir / "metrics.jsonl")
    seen: list[dict[str, Any]] = []

    def reached_step() -> bool:
        seen.extend(metrics.read())
        if not seen:
            state = job_info(cluster, job)["JobState"]
            if state in FINAL_STATES:
                raise RuntimeError(f"hpcdist job {job} ended ({state}) before training:\n{tail_text(out)}")
        return bool(seen) and seen[-1]["step"] >= SIGNAL_AT_STEP

    wait_until(f"step {SIGNAL_AT_STEP} of job {job}", reached_step, 300, lambda: tail_text(out))
    first_step = min(r["time"] for r in seen)
    watch = JobWatch(cluster, job)
    t0 = time.time()
    run_cmd(cluster, "scancel", "--signal=USR2", "--batch", job)  # what --signal=B:USR2@300 delivers
    releaser = Releaser(cluster, job) if policy == "released" else None

    marker: dict[str, Any] | None = None
    resumed: dict[str, Any] | None = None
    after: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout_s
    while resumed is None:
        info = watch.poll()
        if info["JobState"] in FINAL_STATES:
            raise RuntimeError(f"hpcdist job {job} ended ({info['JobState']}) before resuming:\n{tail_text(out)}")
        if marker is None:
            found = sorted((run_dir / "checkpoints").glob("step-*/COMPLETE"))
            if found:
                marker = json.loads(found[-1].read_text())
        after.extend(r for r in metrics.read() if r["time"] > t0)
        if marker is not None:
            resumed = next((r for r in after if r["step"] > marker["step"]), None)
        if resumed is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job}: no resumed step {timeout_s:.0f} s after USR2: {info}\n{tail_text(out)}")
            time.sleep(POLL_S)
    assert marker is not None
    if releaser is not None:
        releaser.join()
    end_job(cluster, job)

    text = out.read_text(errors="replace")
    problems = []
    if resumed["step"] != marker["step"] + 1:
        problems.append(f"first resumed step {resumed['step']}, checkpoint at step {marker['step']}")
    if "restart 1" not in text or "resumed from" not in text:
        problems.append("the job output shows no 'restart 1' / 'resumed from'")
    if problems:
        raise RuntimeError(f"job {job}: {'; '.join(problems)}\n{tail_text(out)}")
    events = {k: v - t0 for k, v in watch.events.items()}
    total = resumed["time"] - t0
    running = events.get("running_again")
    return {
        "job": job,
        "t0": t0,
        "submitted_to_first_step_s": first_step - submitted,
        "signal_at_step": max(r["step"] for r in seen),
        "checkpoint_step": marker["step"],
        "checkpoint_save_s": marker.get("save_seconds"),
        "checkpoint_s": marker["time"] - t0,
        "requeued_s": events.get("requeued"),
        "running_again_s": running,
        "first_resumed_step": resumed["step"],
        "running_to_resumed_step_s": total - running if running is not None else None,
        "total_s": total,
        "release_returned_s": releaser.done_at - t0 if releaser and releaser.done_at else None,
    }


# ------------------------------------------------------------------------------------------------- report


def summary(values: Sequence[float | None]) -> dict[str, float | None]:
    xs = [v for v in values if v is not None]
    if not xs:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def cell(s: dict[str, float | None], repeats: int) -> str:
    if s["median"] is None:
        return "-"
    if repeats == 1:
        return f"{s['median']:.2f}"
    return f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})"


# (label, source, key); the hpcdist rows are seconds after the USR2, the bare row after `scontrol requeue`
ROWS: list[tuple[str, str, str]] = [
    ("bare job: scontrol requeue -> job seen requeued", "bare", "requeued_s"),
    ("bare job: scontrol requeue -> script starts again = BARE", "bare", "delay_s"),
    ("hpcdist: USR2 -> checkpoint COMPLETE", "hpcdist", "checkpoint_s"),
    ("hpcdist: USR2 -> job requeued (Restarts=1)", "hpcdist", "requeued_s"),
    ("hpcdist: USR2 -> job RUNNING again", "hpcdist", "running_again_s"),
    ("hpcdist: RUNNING again -> first resumed step", "hpcdist", "running_to_resumed_step_s"),
    ("hpcdist: USR2 -> first resumed step = TOTAL", "hpcdist", "total_s"),
    ("hpcdist overhead = TOTAL - BARE", "overhead", "overhead_s"),
]


def report_table(report: dict[str, Any]) -> str:
    n = report["args"]["repeats"]
    s = report["summary"]
    rows: list[Sequence[str]] = [
        ("seconds" + (", median (min-max)" if n > 1 else ""), *(POLICY_TITLES[p] for p in POLICIES))
    ]
    for label, source, key in ROWS:
        rows.append((label, *(cell(s[p][source][key], n) for p in POLICIES)))
    verdict = [(f"overhead <= {GOAL_S:g} s", *("PASS" if s[p]["pass"] else "FAIL" for p in POLICIES))]
    h = report["rounds"][0]["hpcdist"]["kept"]
    head = (
        f"requeue: {n} round(s) of {{bare, hpcdist}} x {{{', '.join(POLICY_TITLES[p] for p in POLICIES)}}} on a "
        f"1-node sandbox (hold = cred_expire + 1 = 31 s); hpcdist: sbatch/train.sh configs/demo.yaml + "
        f"tiny_overrides, 2 tasks x 1 CPU, USR2 at step >= {SIGNAL_AT_STEP} (checkpoint at step "
        f"{h['checkpoint_step']}, save {h['checkpoint_save_s'] or 0:.2f} s)"
    )
    la, lb = report["loadavg_start"], report["loadavg_end"]
    foot = f"load average (1 min) at start / end: {la:.2f} / {lb:.2f} on {report['machine']['cpu_count']} cores"
    return "\n".join([head, table([*rows, *verdict]), foot])


def machine() -> dict[str, Any]:
    cpu = platform.processor() or ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    # `sbatch --version` needs a reachable config; the daemon answers without one
    ctld = shutil.which("slurmctld") or shutil.which("slurmctld", path="/usr/sbin:/sbin")
    slurm = subprocess.run([ctld or "slurmctld", "-V"], capture_output=True, text=True, check=False).stdout.strip()
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "slurm": slurm,
    }


# ------------------------------------------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    a = p.parse_args(argv)
    if a.repeats < 1:
        p.error("--repeats must be >= 1")
    return a


def write_json(path: str, report: dict[str, Any]) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")


def _raise_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # SIGTERM: unwind through the finally that stops the sandbox


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    if os.geteuid() != 0 or not shutil.which("sbatch"):
        print("error: needs root and slurm-wlm + munge (.ci/install-slurm)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _raise_exit)
    t_start = time.perf_counter()
    started = datetime.datetime.now().astimezone()
    info = machine()
    print(
        f"hpcdist requeue benchmark, {started:%Y-%m-%d %H:%M %Z}: {info['cpu_count']} x {info['cpu']}, "
        f"{info['slurm']}, python {info['python']}",
        flush=True,
    )
    report: dict[str, Any] = {
        "date": started.isoformat(timespec="seconds"),
        "machine": info,
        "args": vars(a),
        "goal_overhead_max_s": GOAL_S,
        "loadavg_start": os.getloadavg()[0],
        "rounds": [],
    }
    d = Path(a.dir).resolve()
    try:
        with _machine_lock(timeout=a.lock_timeout):
            try:
                cluster = start_sandbox(d)
                work = d / "work"
                shutil.rmtree(work, ignore_errors=True)
                work.mkdir(parents=True)
                corpus = prepare_shards(stdlib_corpus(), work / "corpus", max_tokens=CORPUS_TOKENS)
                for r in range(a.repeats):
                    rnd: dict[str, Any] = {"bare": {}, "hpcdist": {}}
                    for policy in POLICIES:
                        log(f"round {r + 1}/{a.repeats}: bare job, hold {policy} ...")
                        b = rnd["bare"][policy] = bench_bare(
                            cluster, work / f"r{r + 1}-bare-{policy}", policy, a.timeout
                        )
                        log(f"  requeue -> start again {b['delay_s']:.2f} s")
                    for policy in POLICIES:
                        log(f"round {r + 1}/{a.repeats}: hpcdist job, hold {policy} ...")
                        h = rnd["hpcdist"][policy] = bench_hpcdist(
                            cluster, work / f"r{r + 1}-hpcdist-{policy}", corpus, policy, a.timeout
                        )
                        log(
                            f"  USR2 -> checkpoint {h['checkpoint_s']:.2f} s, -> first resumed step "
                            f"{h['total_s']:.2f} s"
                        )
                    rnd["overhead"] = {
                        p: {"overhead_s": rnd["hpcdist"][p]["total_s"] - rnd["bare"][p]["delay_s"]} for p in POLICIES
                    }
                    report["rounds"].append(rnd)
            finally:
                if a.keep_sandbox:
                    log(f"sandbox left running: SLURM_CONF={d / 'slurm.conf'}; tools/slurm_sandbox stop --dir {d}")
                else:
                    stop_sandbox(d)
    except (RuntimeError, TimeoutError, AssertionError, subprocess.SubprocessError) as e:
        report["error"] = str(e)
        write_json(a.json, report)
        print(f"error: {e}\n(rounds measured before it: {a.json})", file=sys.stderr)
        return 1

    rounds = report["rounds"]
    report["summary"] = {}
    for p in POLICIES:
        sp: dict[str, Any] = {}
        for source in ("bare", "hpcdist", "overhead"):
            keys = {k for rnd in rounds for k in rnd[source][p] if k.endswith("_s")}
            sp[source] = {k: summary([rnd[source][p].get(k) for rnd in rounds]) for k in sorted(keys)}
        sp["pass"] = sp["overhead"]["overhead_s"]["median"] <= GOAL_S
        report["summary"][p] = sp
    report["loadavg_end"] = os.getloadavg()[0]
    report["wall_s"] = time.perf_counter() - t_start
    print()
    print(report_table(report))
    print(f"\ntotal wall time {report['wall_s']:.0f} s")
    write_json(a.json, report)
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
