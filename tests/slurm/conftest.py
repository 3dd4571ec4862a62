"""The real-SLURM tier: a throwaway cluster started by tools/slurm_sandbox, and helpers to drive it.

Fixtures (session scope; each returns a `Cluster`):
    slurm_cluster    one node `node1` with 8 fake GPUs, slurmctld and slurmd on this host
    slurm_cluster2   three nodes `node1`, `node2`, `node3` (4 fake GPUs each), each in its own network namespace;
                     `node["ifname"]` is the interface to give GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME. Two-node
                     tests ask for --nodes=2 (SLURM takes node1 and node2 on an idle sandbox); the third host is
                     the hot spare of the in-job restart tests (tests/slurm/test_injob_slurm.py)

Only one sandbox runs at a time: both shapes use the node names node1/node2 (in /etc/hosts) and the
same slurm ports. A session-wide manager holds the running one; asking for the other shape stops it
first. Each shape always lives in the same directory (/tmp/hpcdist-slurm-tests/n1 or n2, where the
daemons' logs stay after the session), so its `Cluster` (slurm.conf path, env, nodes) stays valid across
a restart, and an autouse fixture restarts the shape a test asks for whenever it is not running (another
shape ran in between, or a test stopped or broke it). Tests that use `slurm_cluster2` are moved after
the other tests so a session starts each shape once. (The multi-node shape grew from two hosts to three for the
spare-node tests instead of a third shape: every swap restarts the cluster.) Sessions on the same machine take
turns through the lock file /tmp/hpcdist-slurm-tests.lock, and a session first stops what a killed one left running.

A job's output file is truncated when a requeued job starts again, unless it was submitted with
`--open-mode=append`.

Every test under tests/slurm is marked `slurm`. When slurmctld / slurmd / munged are missing and the session
runs as root with apt-get, the first SLURM test installs them (.ci/install-slurm; HPCDIST_NO_SLURM_INSTALL=1
prevents it). Without root, or when that fails, they are skipped ("install slurm-wlm and munge: ..."), and the
run ends with one line saying the tier did not run; with HPCDIST_REQUIRE_SLURM=1 (CI) they fail instead.

Helpers, importable as `from tests.slurm.conftest import sbatch, wait_job, ...`:
    sbatch(cluster, *args, script=None, cwd=None) -> job id
    wait_job(cluster, job_id, timeout=300, states=FINAL_STATES) -> the JobState reached
    job_info(cluster, job_id) -> dict of `scontrol show job -o` (JobState, Restarts, ExitCode, NodeList...)
    job_output(cluster, job_id) -> the job's StdOut file as text
    release_requeue_hold(cluster, job_id, min_restarts=1) -> job_info once the requeued job may run again
    run_cmd(cluster, *cmd, ...) -> subprocess.CompletedProcess with cluster.env
    side_by_side(**drives) -> {name: Future}: several tests' jobs at once (see its docstring)

Finished jobs stay visible to `scontrol show job` for MinJobAge=600 s (there is no accounting database,
so no sacct): wait_job and job_info work for 10 minutes after a job ends.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SANDBOX = REPO / "tools" / "slurm_sandbox"
SANDBOX_ROOT = Path("/tmp/hpcdist-slurm-tests")
LOCK_PATH = Path("/tmp/hpcdist-slurm-tests.lock")
INSTALL_HINT = "install slurm-wlm and munge: .ci/install-slurm"
INSTALL_SCRIPT = REPO / ".ci" / "install-slurm"
# HPCDIST_REQUIRE_SLURM=1 (CI) turns "cannot run the SLURM tier here" from a skip into a failure;
# HPCDIST_NO_SLURM_INSTALL=1 stops the tier from installing slurm-wlm/munge with apt-get by itself.
REQUIRE_ENV = "HPCDIST_REQUIRE_SLURM"
NO_INSTALL_ENV = "HPCDIST_NO_SLURM_INSTALL"
MULTI_NODES = 3  # the multi-node shape: two training hosts and a spare
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
# fixture -> node count of its shape
_SHAPE_FIXTURES = {"slurm_cluster": 1, "slurm_cluster2": MULTI_NODES}


@dataclass(frozen=True)
class Cluster:
    """What a test needs to talk to a running sandbox."""

    dir: Path
    slurm_conf: Path
    nodes: list[dict]  # {"name", "addr", "netns" (None on one node), "gpus", "cpus", "ifname"}
    partition: str
    controller: dict  # {"name", "addr", "port"}
    # The whole environment for sbatch / srun / scontrol: SLURM_CONF, PATH (this python first), HOME,
    # locale. Deliberately not os.environ, so a pytest run inside a real allocation leaks no SLURM_*
    # variables into the sandbox's jobs. Extend with {**cluster.env, "X": "1"}.
    env: dict[str, str] = field(repr=False)

    @property
    def node_names(self) -> list[str]:
        return [n["name"] for n in self.nodes]


# -------------------------------------------------------------------------------------------- helpers


def run_cmd(
    cluster: Cluster, *cmd: str, check: bool = True, timeout: float = 120, cwd: str | Path | None = None, **kw
) -> subprocess.CompletedProcess:
    """Run a command with the cluster's environment; on failure the message carries stdout and stderr."""
    proc = subprocess.run(
        list(cmd), env=kw.pop("env", cluster.env), cwd=cwd, capture_output=True, text=True, timeout=timeout, **kw
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} -> {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def sbatch(cluster: Cluster, *args: str, script: str | None = None, cwd: str | Path | None = None) -> str:
    """Submit a batch job and return its id. `script` is the job script text (a `#!/bin/bash` line is added
    when it has none); without it, pass `--wrap CMD` or a script path in args. Output files land in `cwd`
    (default: <cluster dir>/jobs), as slurm-<id>.out unless args say otherwise."""
    if cwd is None:
        cwd = cluster.dir / "jobs"
        cwd.mkdir(exist_ok=True)
    if script is not None and not script.startswith("#!"):
        script = "#!/bin/bash\n" + script
    proc = run_cmd(cluster, "sbatch", "--parsable", *args, input=script, cwd=cwd)
    return proc.stdout.strip().split(";")[0]  # --parsable prints "<id>" or "<id>;<cluster>"


_KEY = re.compile(r" (?=[A-Za-z][\w:/]*=)")


def job_info(cluster: Cluster, job_id: str) -> dict[str, str]:
    """`scontrol show job -o <id>` as a dict (JobState, Reason, Restarts, ExitCode, NodeList, StdOut, ...)."""
    out = run_cmd(cluster, "scontrol", "show", "job", "-o", str(job_id)).stdout.strip().splitlines()[0]
    info = {}
    for pair in _KEY.split(out):
        key, _, value = pair.partition("=")
        info[key] = value
    return info


def wait_job(cluster: Cluster, job_id: str, timeout: float = 300, states: tuple[str, ...] = FINAL_STATES) -> str:
    """Poll until the job's JobState is one of `states` (e.g. ("RUNNING",)); return it."""
    deadline = time.monotonic() + timeout
    while True:
        info = job_info(cluster, job_id)
        if info["JobState"] in states:
            return info["JobState"]
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} not in {states} after {timeout:.0f} s: {info}")
        time.sleep(0.2)


def job_output(cluster: Cluster, job_id: str) -> str:
    """The text of the job's StdOut file ('' while it does not exist yet)."""
    path = Path(job_info(cluster, job_id)["StdOut"])
    return path.read_text(errors="replace") if path.exists() else ""


def release_requeue_hold(cluster: Cluster, job_id: str, min_restarts: int = 1, timeout: float = 60) -> dict:
    """Make a requeued job eligible to start now instead of after the requeue hold; return its job_info.

    SLURM holds a requeued job (PENDING, Reason=BeginTime) for cred_expire + 1 s: 31 s in the sandbox
    (AuthInfo=cred_expire=30), 121 s with the default. As root, `scontrol update jobid=<id> StartTime=now`
    clears the hold (BeginTime=now is refused). The hold is there for a reason: slurmd rejects a launch
    credential created in the same second as the requeue's kill ("Job credential revoked"), and the job
    then FAILS for good. So this waits until the job has been requeued `min_restarts` times in all and is
    PENDING, lets the clock pass into the next second, then repeats the update until the job runs (or
    pends for another reason, or has ended)."""
    deadline = time.monotonic() + timeout
    requeued_at = None
    while True:
        info = job_info(cluster, job_id)
        state, reason = info["JobState"], info.get("Reason", "")
        requeued = int(info.get("Restarts", "0")) >= min_restarts
        if requeued and (state == "RUNNING" or state in FINAL_STATES or (state == "PENDING" and reason != "BeginTime")):
            return info
        if state in FINAL_STATES:
            raise RuntimeError(f"job {job_id} ended without being requeued {min_restarts} time(s): {info}")
        if requeued and requeued_at is None:
            requeued_at = time.time()
        if state == "PENDING" and requeued_at is not None and time.time() >= int(requeued_at) + 1.2:
            run_cmd(cluster, "scontrol", "update", f"jobid={job_id}", "StartTime=now", check=False)
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} still held after {timeout:.0f} s: {info}")
        time.sleep(0.2)


@contextlib.contextmanager
def side_by_side(**drives: Callable[[], Any]) -> Iterator[dict[str, Future[Any]]]:
    """Run the driving parts of several tests at once, each in a thread; -> {name: Future}, for a module fixture.

    A scenario that signals or kills its job at a given step must be driven while the job runs, so a module fixture
    cannot simply submit every job first and let each test wait for its own (as test_strategies_slurm does). Each
    drive (submit, wait for a step, signal, release the requeue hold, wait for the end) returns what its test asserts
    on; the test calls ``.result()``, and whatever the drive raised (an assertion, a timeout) is raised there, in that
    test. The jobs then train side by side on the sandbox instead of one test after another: the tier's time is
    mostly jobs starting (torch imports) and waiting for steps, which overlap. Leaving the block waits for every
    drive to end (each bounds its own waits)."""
    with ThreadPoolExecutor(max_workers=len(drives), thread_name_prefix="slurm-drive") as pool:
        yield {name: pool.submit(drive) for name, drive in drives.items()}


# ------------------------------------------------------------------------------------------- sandbox


def _cluster_env() -> dict[str, str]:
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", ""), "/usr/sbin:/usr/bin"])
    env = {"PATH": path, "HOME": os.environ.get("HOME", "/root")}
    env |= {k: v for k, v in os.environ.items() if k in ("LANG", "LC_ALL", "TZ", "TMPDIR", "VIRTUAL_ENV")}
    return env


def _missing_tools() -> list[str]:
    return [t for t in ("slurmctld", "slurmd", "munged", "sbatch", "ip", "unshare") if not _which(t)]


def _skip_reason() -> str | None:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return f"the SLURM sandbox needs root ({INSTALL_HINT}, then run pytest as root)"
    missing = _missing_tools()
    if missing and os.environ.get(NO_INSTALL_ENV) != "1" and _which("apt-get"):
        # The real-SLURM tier is the heart of the product: on a fresh root machine the README's test command
        # brings it up itself (what .ci/install-slurm does) instead of quietly skipping it.
        print(f"\n{', '.join(missing)} not found: installing slurm-wlm and munge (.ci/install-slurm)", file=sys.stderr)
        proc = subprocess.run(["bash", str(INSTALL_SCRIPT)], capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            return f"installing slurm-wlm and munge failed ({proc.returncode}: {tail[0]}): {INSTALL_HINT}"
        missing = _missing_tools()
    if missing:
        return f"{', '.join(missing)} not found: {INSTALL_HINT}"
    if subprocess.run(["unshare", "--uts", "true"], capture_output=True).returncode != 0:
        return "`unshare --uts` is not permitted here (the sandbox needs CAP_SYS_ADMIN)"
    return None


def _which(tool: str) -> str | None:
    return shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/sbin")


def _alive(state_file: Path) -> bool:
    """Every daemon recorded in state.json still runs (pid present, not a zombie, same start time)."""
    try:
        pids = json.loads(state_file.read_text()).get("pids", {})
    except (OSError, ValueError):
        return False
    for rec in pids.values():
        try:
            stat = Path(f"/proc/{rec['pid']}/stat").read_text()
        except OSError:
            return False
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] in ("Z", "X") or int(fields[19]) != rec["start"]:
            return False
    return bool(pids)


class _SandboxManager:
    """Holds at most one running sandbox (see the module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.clusters: dict[int, Cluster] = {}
        self.running: int | None = None

    def dir_for(self, nodes: int) -> Path:
        return self.root / f"n{nodes}"

    def use(self, nodes: int) -> Cluster:
        d = self.dir_for(nodes)
        if self.running == nodes and _alive(d / "state.json"):
            return self.clusters[nodes]
        self.stop()
        # private (0700): the sandbox checks that d and every directory above it are root's before it writes
        # anything there, so a root another user made first in /tmp is refused, not used
        self.root.mkdir(mode=0o700, exist_ok=True)
        cmd = [sys.executable, str(SANDBOX), "start", "--nodes", str(nodes), "--dir", str(d), "--json"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
        if proc.returncode != 0:
            pytest.fail(
                f"slurm_sandbox start --nodes {nodes} failed ({proc.returncode}):\n{proc.stderr}", pytrace=False
            )
        # Job ids start again at 1 with every fresh slurmctld: drop the old slurm-<id>.out files (once the sandbox
        # has checked d is ours).
        shutil.rmtree(d / "jobs", ignore_errors=True)
        self.running = nodes
        info = json.loads(proc.stdout)
        env = {**_cluster_env(), "SLURM_CONF": info["slurm_conf"]}
        self.clusters[nodes] = Cluster(
            dir=Path(info["dir"]),
            slurm_conf=Path(info["slurm_conf"]),
            nodes=info["nodes"],
            partition=info["partition"],
            controller=info["controller"],
            env=env,
        )
        return self.clusters[nodes]

    def stop(self) -> None:
        if self.running is None:
            return
        d = self.dir_for(self.running)
        self.running = None
        proc = subprocess.run([sys.executable, str(SANDBOX), "stop", "--dir", str(d)], capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"slurm_sandbox stop --dir {d} failed:\n{proc.stderr}", file=sys.stderr)


@pytest.fixture(scope="session")
def _slurm_sandbox():
    reason = _skip_reason()
    if reason:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but the SLURM tier cannot run: {reason}", pytrace=False)
        print(f"\nskipping SLURM tests: {reason}", file=sys.stderr)
        pytest.skip(reason)
    with _machine_lock():
        # Fixed dirs (short: slurmstepd puts unix sockets under the spool dir, 108-byte limit), so that a
        # session killed before its teardown leaves daemons this one can find and stop; the logs of the
        # last session stay there for a look. The lock makes this session the only user of those dirs.
        for nodes in (1, 2, MULTI_NODES):
            if (SANDBOX_ROOT / f"n{nodes}" / "state.json").exists():
                subprocess.run([sys.executable, str(SANDBOX), "stop", "--dir", str(SANDBOX_ROOT / f"n{nodes}")])
        manager = _SandboxManager(SANDBOX_ROOT)
        try:
            yield manager
        finally:
            manager.stop()


@contextlib.contextmanager
def _machine_lock(timeout: float = 1800):
    """One pytest session at a time may run a sandbox on this machine: node names, /etc/hosts entries and
    slurm ports are machine-wide. A second session (another checkout, an xdist worker) waits here."""
    # never through a link another user planted at that name in /tmp
    with open(LOCK_PATH, "a", opener=lambda path, flags: os.open(path, flags | os.O_NOFOLLOW, 0o644)) as f:
        deadline = time.monotonic() + timeout
        waited = False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not waited:
                    print(f"\nwaiting for {LOCK_PATH}: another pytest session runs the SLURM sandbox", file=sys.stderr)
                    waited = True
                if time.monotonic() > deadline:
                    pytest.fail(f"{LOCK_PATH} still held after {timeout:.0f} s", pytrace=False)
                time.sleep(1)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def slurm_cluster(_slurm_sandbox: _SandboxManager) -> Cluster:
    """One node `node1`, 8 fake GPUs, partition `debug`."""
    return _slurm_sandbox.use(1)


@pytest.fixture(scope="session")
def slurm_cluster2(_slurm_sandbox: _SandboxManager) -> Cluster:
    """Three nodes `node1`, `node2`, `node3` in network namespaces, 4 fake GPUs each, partition `debug`."""
    return _slurm_sandbox.use(MULTI_NODES)


@pytest.fixture(autouse=True)
def _slurm_shape(request: pytest.FixtureRequest) -> None:
    """Make sure the shape this test asked for is the one running (it may have been swapped or stopped)."""
    wanted = {n for name, n in _SHAPE_FIXTURES.items() if name in request.fixturenames}
    if len(wanted) > 1:
        pytest.fail(
            "a test cannot use slurm_cluster and slurm_cluster2 together (they share node names)", pytrace=False
        )
    if wanted:
        request.getfixturevalue("_slurm_sandbox").use(wanted.pop())


# Tests that stop the running sandbox themselves: last of all, so no test after them waits for a fresh start.
_STOPS_THE_SANDBOX = ("test_stop_removes_everything_it_started",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test here `slurm`; run the two-node tests after the one-node ones (one swap per session), and the
    test that stops the sandbox last (before, the multi-node shape was started a second time after it)."""
    ours = [item for item in items if HERE in Path(item.path).resolve().parents]
    for item in ours:
        item.add_marker(pytest.mark.slurm)
    two = {id(item) for item in ours if "slurm_cluster2" in getattr(item, "fixturenames", ())}
    stops = {id(item) for item in ours if getattr(item, "originalname", item.name) in _STOPS_THE_SANDBOX}

    def rank(item: pytest.Item) -> int:
        return 2 if id(item) in stops else 1 if id(item) in two else 0

    items.sort(key=rank)  # stable: the order within each group stays
