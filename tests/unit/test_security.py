"""Issue 14: a shared cluster where other local users can write to /tmp and to group directories.

One test per finding, each playing the other user with a made-up uid (root chowns files to it, or a forked child
drops to it): a planted checkpoint, the supervisor's task-info race, a sandbox directory that is not the sandbox's.
docs/SECURITY.md states the threat model and names these tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcdist.fault.failures import read_failures

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
