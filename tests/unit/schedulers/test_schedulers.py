"""hpcdist.schedulers: the job's facts read once, through a per-scheduler table, into the
scheduler-neutral JobFacts that DistEnv.job carries to the trainer and hpcdist.fault."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

from hpcdist import schedulers
from hpcdist.env import from_environ, port_from_job_id
from hpcdist.fault.failures import read_failures, record
from hpcdist.schedulers import JobFacts, Scheduler, job_facts
from hpcdist.schedulers.slurm import expand_nodelist
from tests.conftest import REPO

ARRAY_TASK = {  # task 3 of array job 7, itself job 8, requeued twice, in a batch script (no srun step)
    "SLURM_JOB_ID": "8",
    "SLURM_JOBID": "8",
    "SLURM_ARRAY_JOB_ID": "7",
    "SLURM_ARRAY_TASK_ID": "3",
    "SLURM_RESTART_COUNT": "2",
    "SLURM_JOB_PARTITION": "gpu",
    "SLURM_JOB_NUM_NODES": "3",
    "SLURM_NNODES": "3",
    "SLURM_JOB_NODELIST": "gpu[008-009],login2",
    "SLURM_PROCID": "0",
}


def test_slurm_array_task_facts() -> None:
    job = job_facts(ARRAY_TASK)
    assert job == JobFacts(
        "7_3",
        2,
        scheduler="slurm",
        instance_id="8_3",
        array_job_id="7",
        array_task_id="3",
        partition="gpu",
        num_nodes=3,
        node_list="gpu[008-009],login2",
    )
    assert expand_nodelist(job.node_list or "") == ["gpu008", "gpu009", "login2"]


def test_plain_slurm_job_and_its_defaults() -> None:
    assert job_facts({"SLURM_JOB_ID": "5", "SLURM_RESTART_COUNT": "2"}) == JobFacts(
        "5", 2, scheduler="slurm", instance_id="5"
    )
    # empty variables count as unset, as everywhere in hpcdist.env
    assert job_facts({"SLURM_JOB_ID": "5", "SLURM_RESTART_COUNT": "", "SLURM_JOB_PARTITION": " "}) == JobFacts(
        "5", 0, scheduler="slurm", instance_id="5"
    )


def test_array_task_without_its_array_id_keeps_its_own_job_id() -> None:
    """SLURM sets both; without SLURM_ARRAY_JOB_ID the old reader raised KeyError. The task's own job id is one
    scontrol requeues too."""
    job = job_facts({"SLURM_JOB_ID": "8", "SLURM_ARRAY_TASK_ID": "3"})
    assert (job.job_id, job.instance_id, job.array_task_id) == ("8", "8_3", "3")


def test_no_scheduler() -> None:
    assert job_facts({}) == JobFacts() == JobFacts(None, 0)
    assert JobFacts().scheduler is None and JobFacts().instance_id is None
    env = from_environ({"MASTER_PORT": "23456"}, cuda_available=False)
    assert (env.job, env.job_id, env.launcher) == (JobFacts(), None, "single")


@pytest.mark.parametrize("name", ["SLURM_RESTART_COUNT", "SLURM_JOB_NUM_NODES"])
def test_a_garbled_count_names_its_variable(name: str) -> None:
    with pytest.raises(ValueError, match=f"{name}='two' is not an integer"):
        job_facts({"SLURM_JOB_ID": "5", name: "two"})
    with pytest.raises(ValueError, match=f"{name}='two' is not an integer"):
        from_environ({"SLURM_JOB_ID": "5", name: "two"}, cuda_available=False)


@pytest.mark.parametrize(
    "launcher_vars",
    [
        {},  # the batch script itself
        {"TORCHELASTIC_RUN_ID": "none", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h"},
    ],
)
def test_distenv_carries_the_job_facts_under_every_launcher(launcher_vars: dict[str, str]) -> None:
    env = from_environ({**ARRAY_TASK, **launcher_vars}, cuda_available=False)
    assert env.job == job_facts(ARRAY_TASK)
    # DistEnv.job_id stays the port seed (<job>_<task>), apart from the id the scheduler requeues (<array>_<task>)
    assert (env.job_id, env.job.job_id) == ("8_3", "7_3")


def test_srun_step_port_comes_from_the_job_instance() -> None:
    step = {
        **ARRAY_TASK,
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_TASKS_PER_NODE": "2",
        "SLURM_STEP_NUM_NODES": "1",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "MASTER_ADDR": "gpu008",
    }
    env = from_environ(step, cuda_available=False)
    assert (env.launcher, env.world_size, env.master_port) == ("slurm", 2, port_from_job_id("8_3"))
    assert env.job.restart_count == 2


def _pbs_facts(environ: Mapping[str, str]) -> JobFacts | None:
    job = environ.get("PBS_JOBID")
    return JobFacts(job, 0, scheduler="pbs", instance_id=job) if job else None


def test_a_new_scheduler_is_one_row_and_nothing_in_fault(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The change request on paper, run: a PBS row in the table (no step launcher of its own here) and the rank's
    DistEnv, failure records and rendezvous port follow it; hpcdist.fault was not touched for it."""
    pbs = Scheduler(name="pbs", job_facts=_pbs_facts, step_layout=lambda reader: None, reads=())
    monkeypatch.setattr(schedulers, "SCHEDULERS", (*schedulers.SCHEDULERS, pbs))
    for name in [n for n in os.environ if n.startswith("SLURM_")]:  # also when this test runs inside a SLURM job
        monkeypatch.delenv(name)
    monkeypatch.setenv("PBS_JOBID", "77.server")
    env = from_environ({"PBS_JOBID": "77.server"}, cuda_available=False)
    assert (env.job.scheduler, env.job.job_id, env.job_id) == ("pbs", "77.server", "77.server")
    record(tmp_path, kind="exception", cause="boom", rank=0)  # no job passed: read through the table
    record(tmp_path, kind="exception", cause="boom", rank=0, job=env.job)
    assert [r["job_id"] for r in read_failures(tmp_path)] == ["77.server", "77.server"]


def test_the_scheduler_table_loads_no_torch() -> None:
    """The batch script's after-step and the per-rank supervisor side read job facts before (or without) torch."""
    code = "import sys, hpcdist.schedulers; assert 'torch' not in sys.modules, 'torch'"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_slurm_launcher_implements_every_launcher_member() -> None:
    """hpcdist.launch drives a scheduler only through the Launcher Protocol: SLURM's has all of it, with the same
    parameters, so another scheduler's package knows exactly what to provide."""
    import inspect

    from hpcdist.schedulers import Launcher, launcher
    from hpcdist.schedulers.slurm import LAUNCHER, SlurmLauncher

    assert launcher("slurm") is LAUNCHER
    members = {n for n in dir(Launcher) if not n.startswith("_")} | set(Launcher.__annotations__)
    missing = sorted(n for n in members if not hasattr(LAUNCHER, n))
    assert not missing, missing
    for name in members:
        wanted = getattr(Launcher, name, None)
        if callable(wanted):
            got = inspect.signature(getattr(SlurmLauncher, name))
            assert list(got.parameters) == list(inspect.signature(wanted).parameters), name
    with pytest.raises(ValueError, match="no launcher for scheduler 'pbs'"):
        launcher("pbs")


@pytest.mark.parametrize(
    "args",
    [
        ["--kill-on-bad-exit=1", "--unbuffered", "python", "-m", "hpcdist", "train", "c.yaml"],
        ["-K1", "--unbuffered", "python", "-m", "hpcdist", "train", "c.yaml"],
        ["--unbuffered", "--output", "/o/%j_%t.out", "--error", "/o/%j_%t.err", "python", "-u", "-m", "s"],
    ],
)
def test_a_step_that_keeps_its_survivors_turns_kill_on_bad_exit_off(args: list[str]) -> None:
    """In-process recovery needs the other tasks alive after one dies: the step line's own --kill-on-bad-exit goes,
    =0 comes first, and the program's arguments (which may look like srun options) are left as they are."""
    from hpcdist.schedulers.slurm.step import step_command

    out = step_command(["srun", *args, "--kill-on-bad-exit=1"], ["n1", "n2"], 4, keep_survivors=True)
    assert out[:5] == ["srun", "--nodes=2", "--ntasks=8", "--nodelist=n1,n2", "--kill-on-bad-exit=0"]
    srun_own = ("--kill-on-bad-exit=1", "-K1")
    assert out[5:] == [a for a in args if a not in srun_own] + ["--kill-on-bad-exit=1"]  # the program's: untouched
    assert step_command(["srun", *args], ["n1"], 4)[4:] == args  # without it, the line is the line


def test_the_spares_step_writes_its_own_output_files_never_the_ranks() -> None:
    """The warm spares' step numbers its tasks from 0 like the training step: submitit's per-task log patterns get
    a ``spare-`` prefix (both option spellings), a line without them is unchanged, and the program's own arguments
    that look like srun options are left alone."""
    from hpcdist.schedulers.slurm.step import step_command

    line = ["srun", "--unbuffered", "--output", "/o/%j_%t_log.out", "--error=/o/%j_%t_log.err", "-o", "x.out"]
    program = ["python", "-u", "-m", "submitit.core._submit", "/o", "--output", "/o/keep"]
    out = step_command([*line, *program], ["n3"], 2, keep_survivors=True, spares=True)
    assert out == [
        "srun", "--nodes=1", "--ntasks=2", "--nodelist=n3", "--kill-on-bad-exit=0", "--unbuffered",
        "--output", "/o/spare-%j_%t_log.out", "--error=/o/spare-%j_%t_log.err", "-o", "spare-x.out", *program,
    ]  # fmt: skip
    plain = ["srun", "--unbuffered", "hpcdist", "train", "c.yaml"]
    assert step_command(plain, ["n3"], 2, spares=True)[4:] == plain[1:]
    assert step_command(["srun", "--output=none", *program], ["n3"], 1, spares=True)[4] == "--output=none"
