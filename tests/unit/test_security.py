"""A shared cluster where other local users can write to /tmp and to group directories.

One test per finding, each playing the other user with a made-up uid (root chowns files to it, or a forked child
drops to it): a planted checkpoint, the supervisor's task-info race, a sandbox directory that is not the sandbox's.
docs/SECURITY.md states the threat model and names these tests.
"""

from __future__ import annotations

import json
import os
import pickle
import pwd
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hpcdist.checkpoint.manager import CheckpointManager
from hpcdist.checkpoint.names import DAMAGED, MARKER
from hpcdist.checkpoint.state import STATE_FILE, Checkpointable
from hpcdist.cli import main
from hpcdist.config import ConfigError
from hpcdist.config.dirs import tree_trust_problems
from hpcdist.fault.failures import read_failures
from tests.conftest import SMALL

REPO = Path(__file__).resolve().parents[2]
OTHER_UID = 4242  # a user of this machine who is not us


def _needs_root() -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to act as a second uid (chown / setuid; CI runs as root)")


# --------------------------------------------------------------------------------------------- supervisor (14.2)


def test_supervisor_task_info_cannot_be_planted_by_another_user(tmp_path: Path) -> None:
    """The rank is killed before it could announce itself (start-up). Another user who learned the task-info name
    (a predictable temporary name in a shared /tmp, before) creates it with a record pointing at a file of the
    victim's: the supervisor must neither append to that file nor lose the rank's death."""
    _needs_root()
    victim_file = tmp_path / "bashrc"
    victim_file.write_text("# the victim's shell start-up\n")
    attack = json.dumps({"failures": str(victim_file), "rank": "echo pwned"})
    # the rank forks the other user (as a watcher of /tmp would be), who plants the file, then the rank dies
    child = (
        "import os, sys\n"
        "name = os.environ['HPCDIST_TASK_INFO']\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        f"    os.setgid({OTHER_UID}); os.setuid({OTHER_UID})\n"
        "    try:\n"
        "        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)\n"
        f"        os.write(fd, {attack!r}.encode()); os._exit(0)\n"
        "    except OSError as e:\n"
        "        print('planting refused:', e, file=sys.stderr); os._exit(1)\n"
        "os.waitpid(pid, 0)\n"
        "os.kill(os.getpid(), 9)\n"
    )
    cmd = [sys.executable, "-m", "hpcdist.fault.supervise", "--", sys.executable, "-c", child]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert victim_file.read_text() == "# the victim's shell start-up\n", "the other user chose where we append"
    assert p.returncode == -9, p.stderr  # the supervisor did not crash: it died like its rank, as srun expects
    assert "killed by signal 9" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert "planting refused" in p.stderr  # the name lives in a directory only we can write


def test_supervisor_task_info_is_private_and_gone_afterwards(tmp_path: Path) -> None:
    """The name the rank gets is in a 0700 directory of ours; after the rank ends nothing of it is left."""
    seen = tmp_path / "seen.json"
    child = (
        "import json, os, stat\n"
        "from pathlib import Path\n"
        "d = Path(os.environ['HPCDIST_TASK_INFO']).parent\n"
        "st = d.lstat()\n"
        f"Path({str(seen)!r}).write_text(json.dumps([str(d), stat.S_IMODE(st.st_mode), st.st_uid]))\n"
        "from hpcdist.fault.failures import announce_task\n"
        f"announce_task({str(tmp_path)!r}, rank=0, host='h')\n"
    )
    cmd = [sys.executable, "-m", "hpcdist.fault.supervise", "--", sys.executable, "-c", child]
    assert subprocess.run(cmd, cwd=REPO, timeout=60).returncode == 0
    d, mode, uid = json.loads(seen.read_text())
    assert (mode, uid) == (0o700, os.getuid())
    assert not Path(d).exists()
    assert not read_failures(tmp_path)


# --------------------------------------------------------------------------------------------- checkpoints (14.1)


class _Payload:
    """What a planted .metadata holds: unpickling it calls os.mkdir(path), i.e. runs the planter's code (mkdir, not
    open: the trusted case does unpickle it, and an open file left to the garbage collector is a ResourceWarning)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.path),))


def _plant(step: Path, pwned: Path, uid: int) -> Path:
    """A checkpoint as its planter would make it: a pickle that runs code, a manifest that vouches for it (whoever
    plants the files writes the manifest too), the completion marker; everything owned by ``uid``."""
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(pickle.dumps(_Payload(pwned)))
    (step / STATE_FILE).write_text(json.dumps({"step": 5}))
    CheckpointManager(step.parent, rank=0, world_size=1)._write_manifest(step, distributed=True)
    (step / MARKER).write_text("{}")
    for p in [step, *step.rglob("*")]:
        os.lchown(p, uid, uid)
    return step


def _nothing() -> Checkpointable:
    return Checkpointable(
        dcp_state=dict, load_dcp_state=lambda s: None, trainer_state=dict, load_trainer_state=lambda s: None
    )


def _restore(root: Path, resume: str, **kw: Any) -> Path | None:
    return CheckpointManager(root, rank=0, world_size=1, **kw).restore(resume, _nothing())


def test_a_checkpoint_planted_by_another_user_is_refused_before_anything_is_unpickled(tmp_path: Path) -> None:
    _needs_root()
    pwned = tmp_path / "PWNED"
    theirs = _plant(tmp_path / "theirs" / "step-00000005", pwned, OTHER_UID)
    # checkpoint.resume=<their step dir>
    with pytest.raises(ConfigError) as e:
        _restore(tmp_path / "mine", str(theirs))
    msg = str(e.value)
    assert "checkpoint.resume" in msg and str(theirs) in msg and f"uid {OTHER_UID}" in msg, msg
    assert "checkpoint.trusted_owners" in msg, msg
    # a step directory of theirs inside my own run dir, found by resume=auto: refused, not demoted or skipped
    mine = tmp_path / "mine"
    planted = _plant(mine / "step-00000009", pwned, OTHER_UID)
    refusal = r"checkpoint.resume=auto: \S+/step-00000009 cannot be trusted: belongs to uid 4242, not to you \(.*\): "
    with pytest.raises(ConfigError, match=refusal + r"\S+/step-00000009 and 4 more\."):  # one line for the tree
        _restore(mine, "auto")
    assert not pwned.exists(), "the planted pickle ran"
    assert (planted / MARKER).is_file() and not (planted / DAMAGED).exists()  # not ours to touch


def test_untrusted_checkpoint_through_the_cli_is_one_message_and_exit_2(tmp_path: Path, capsys) -> None:
    _needs_root()
    pwned = tmp_path / "PWNED"
    theirs = _plant(tmp_path / "theirs" / "step-00000005", pwned, OTHER_UID)
    for key in ("checkpoint.resume", "checkpoint.init_from"):
        over = [*SMALL, "data.source=synthetic", "data.synthetic_samples=64", f"run.dir={tmp_path / key}"]
        assert main(["train", "configs/demo.yaml", *over, f"{key}={theirs}"]) == 2
        err = capsys.readouterr().err
        assert f"{key}: {theirs}" in err and f"belongs to uid {OTHER_UID}" in err and "Traceback" not in err, err
        assert not pwned.exists()


def test_writable_by_others_or_linked_out_is_refused_and_a_trusted_owner_is_allowed(tmp_path: Path) -> None:
    """My own files, but writable by a shared group or everyone, or a link to a file elsewhere: refused with the
    fix. A read-only checkpoint of a user named in checkpoint.trusted_owners loads."""
    _needs_root()
    me = os.getuid()
    pwned = tmp_path / "PWNED"
    step = _plant(tmp_path / "a" / "step-00000001", pwned, me)
    os.chmod(step / ".metadata", 0o646)
    with pytest.raises(ConfigError, match=r"writable by others \(mode 0646\): \S+/\.metadata\. .*chmod -R go-w"):
        _restore(step.parent, str(step))
    os.chmod(step / ".metadata", 0o664)
    os.chown(step / ".metadata", me, 100)  # group 'users': not a group of mine alone
    with pytest.raises(ConfigError, match=r"writable by group users \(mode 0664\): \S+/\.metadata\."):
        _restore(step.parent, str(step))
    os.chown(step / ".metadata", me, pwd.getpwuid(me).pw_gid)  # my private group (umask 002 sites): only me
    assert tree_trust_problems(step, {me}) == []
    os.chmod(step / ".metadata", 0o644)
    elsewhere = tmp_path / "elsewhere.bin"
    shutil.move(step / STATE_FILE, elsewhere)
    (step / STATE_FILE).symlink_to(elsewhere)
    link_out = r"is a link leading out of the checkpoint \(to \S+/elsewhere.bin\): \S+/trainer_state.json\."
    with pytest.raises(ConfigError, match=link_out):
        _restore(step.parent, str(step))
    assert not pwned.exists()
    # a shared, read-only checkpoint of a trusted user: passes the check (and then loads as any other would)
    nobody = pwd.getpwnam("nobody")
    shared = _plant(tmp_path / "shared" / "step-00000002", pwned, nobody.pw_uid)
    with pytest.raises(ConfigError, match="belongs to nobody"):
        _restore(shared.parent, str(shared))
    with pytest.raises(ConfigError, match=r"checkpoint.trusted_owners: .no-such-user-x. is not a user"):
        CheckpointManager(shared.parent, rank=0, world_size=1, trusted_owners=["no-such-user-x"])
    assert not pwned.exists()
    with pytest.raises(Exception):  # noqa: B017 - past the check, DCP reads the planted pickle: trusted means trusted
        _restore(shared.parent, str(shared), trusted_owners=["nobody"])
    assert pwned.exists()


def test_the_ownership_check_stats_and_never_reads(tmp_path: Path) -> None:
    """A checkpoint of 2,000 files: every one is looked at (a bad one among them is found), none is opened."""
    step = tmp_path / "step-00000001"
    for i in range(20):
        sub = step / f"d{i}"
        sub.mkdir(parents=True)
        for j in range(100):
            (sub / f"f{j}").write_bytes(b"")
    os.chmod(step / "d19" / "f99", 0o666)
    opened: list[str] = []
    sys.addaudithook(
        lambda ev, args: opened.append(str(args[0])) if ev == "open" and str(step) in str(args[0]) else None
    )
    t0 = time.perf_counter()
    problems = tree_trust_problems(step, {os.getuid()})
    seconds = time.perf_counter() - t0
    assert problems == [(str(step / "d19" / "f99"), "is writable by others (mode 0666)")], problems
    assert not opened, opened[:3]
    print(f"ownership walk: 2,020 entries in {seconds * 1000:.1f} ms")


# ------------------------------------------------------------------------------------------ slurm sandbox (14.3)

SANDBOX = REPO / "tools" / "slurm_sandbox"


def _start_time(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[19])


def _forged_state(d: Path, victim: subprocess.Popen[bytes], links: list[str]) -> None:
    """A state file naming a process and a link that are not the sandbox's, as a planter would write it (or as a
    stale state file reads once its pids are reused)."""
    rec = {"pid": victim.pid, "start": _start_time(victim.pid), "argv": ["slurmctld"]}
    state = {
        "dir": str(d),
        "slurm_conf": str(d / "slurm.conf"),
        "pids": {"slurmctld": rec},
        "supervisor": None,
        "netns": [],
        "links": links,
        "hosts_block": False,
    }
    (d / "state.json").write_text(json.dumps(state))


def _sandbox(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SANDBOX), *args], capture_output=True, text=True, timeout=60)


def test_sandbox_refuses_a_directory_another_user_created(tmp_path: Path) -> None:
    """Another user made the sandbox directory first (/tmp is everyone's) and left a state file in it: start and
    stop refuse it, write nothing there and kill nothing it names."""
    _needs_root()
    d = tmp_path / "hpcdist-slurm"
    d.mkdir(mode=0o777)
    victim = subprocess.Popen(["sleep", "60"])
    try:
        _forged_state(d, victim, [])
        os.chown(d, OTHER_UID, OTHER_UID)
        os.chown(d / "state.json", OTHER_UID, OTHER_UID)
        before = sorted(p.name for p in d.iterdir())
        for cmd in ("start", "stop", "status"):
            p = _sandbox(cmd, "--dir", str(d))
            assert p.returncode == 2 and f"belongs to uid {OTHER_UID}" in p.stderr, (cmd, p.stderr)
            assert victim.poll() is None, f"`{cmd}` killed a process named in another user's state file"
        assert sorted(p.name for p in d.iterdir()) == before  # no munge key, no slurm.conf written there
    finally:
        victim.kill()
        victim.wait()


def test_sandbox_stop_acts_only_on_its_own_processes_and_links(tmp_path: Path) -> None:
    """Our own directory, but its state names a process the sandbox did not start (a pid reused since, or a
    state file edited) and a link that is not one of its names: stop leaves both alone."""
    _needs_root()
    d = tmp_path / "sb"
    d.mkdir(mode=0o700)
    link = "hpcdx-victim0"
    add = ["ip", "link", "add", link, "type", "veth", "peer", "name", f"{link}p"]  # the sandbox makes veths too
    has_link = subprocess.run(add, capture_output=True).returncode == 0
    if not has_link:
        print("no veth pair could be made here (needs CAP_NET_ADMIN): only the process half runs")
    victim = subprocess.Popen(["sleep", "60"])
    try:
        _forged_state(d, victim, [link] if has_link else [])
        p = _sandbox("stop", "--dir", str(d))
        assert p.returncode == 0, p.stderr
        assert victim.poll() is None, "stop killed a process the sandbox never started"
        assert "not a process of this sandbox" in p.stderr, p.stderr
        if has_link:
            assert subprocess.run(["ip", "link", "show", link], capture_output=True).returncode == 0
            assert "not a link of this sandbox" in p.stderr, p.stderr
    finally:
        victim.kill()
        victim.wait()
        if has_link:
            subprocess.run(["ip", "link", "delete", link], capture_output=True)


def test_every_test_docs_security_names_exists() -> None:
    """docs/SECURITY.md names a test for each defence: each must be there (``::name`` alone: the file named last)."""
    text = (REPO / "docs" / "SECURITY.md").read_text()
    named, current = [], None
    for ref in re.findall(r"`((?:tests/\S+?\.py)?(?:::\w+)?)`", text):
        path, _, name = ref.partition("::")
        current = path or current
        if name:
            named.append((current, name))
    assert len(named) >= 10, named
    for path, name in named:
        assert re.search(rf"^def {name}\(", (REPO / path).read_text(), re.M), f"{path}::{name} does not exist"
