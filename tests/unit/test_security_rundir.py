"""What ``hpcdist status`` reads, where Prometheus listens, and how run-dir files are
appended, each tried as another local user would (root chowns files to a made-up uid). docs/SECURITY.md names
these tests.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hpcdist.cli import main
from hpcdist.config import ConfigError, check_run_dir
from hpcdist.launch.records import record_job
from hpcdist.launch.submit import JobHandle

OTHER_UID = 4242  # a user of this machine who is not us
DEAD_PID = 999998  # no process: the "job" has ended


def _needs_root() -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to act as a second uid (chown; CI runs as root)")


class _Payload:
    """Unpickling this creates ``path``: the proof that a pickle was loaded (as os.system(...) would run)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


def _chown_tree(top: Path, uid: int) -> None:
    for p in [top, *top.rglob("*")]:
        os.lchown(p, uid, uid)


def _plant_local_job(theirs: Path, pwned: Path, *, job_id: int = DEAD_PID) -> None:
    """Another user's run dir as they would make it: a jobs.jsonl record of a local job on this host whose
    controller is gone, and in the record's log folder a result pickle (what submitit writes) that runs code."""
    folder = theirs / "slurm"
    folder.mkdir(parents=True)
    entry = {
        "job_id": str(job_id),
        "executor": "local",
        "folder": str(folder),
        "num_tasks": 1,
        "snapshot": None,
        "time": 0,
        "host": socket.gethostname(),
    }
    (theirs / "jobs.jsonl").write_text(json.dumps(entry) + "\n")
    (folder / f"{job_id}_0_result.pkl").write_bytes(pickle.dumps(("success", _Payload(pwned))))
    _chown_tree(theirs, OTHER_UID)


# --------------------------------------------------------------------------------------------- item 1: no pickle


def test_status_of_another_users_local_job_unpickles_nothing(tmp_path: Path, capsys) -> None:
    """`hpcdist status 999998 --run-dir THEIR_DIR`: their record and their pickle. Nothing is unpickled (the marker
    never appears), their records are not taken as ours (one line, exit 2, naming the file and its owner)."""
    _needs_root()
    pwned = tmp_path / "PWNED"
    theirs = tmp_path / "theirs"
    _plant_local_job(theirs, pwned)
    code = main(["status", str(DEAD_PID), "--run-dir", str(theirs)])
    err = capsys.readouterr().err
    assert not pwned.exists(), "hpcdist status ran code another user planted"
    assert code == 2 and "jobs.jsonl" in err and f"uid {OTHER_UID}" in err and "Traceback" not in err, err
    # cancel and logs read the same record: refused alike, nothing signalled or read through it
    assert main(["cancel", str(DEAD_PID), "--run-dir", str(theirs)]) == 2
    assert main(["logs", str(DEAD_PID), "--run-dir", str(theirs)]) == 2
    assert f"uid {OTHER_UID}" in capsys.readouterr().err
    assert not pwned.exists()


def test_a_result_pickle_in_our_own_run_dir_is_never_unpickled(tmp_path: Path, capsys) -> None:
    """Our own record (a shared log folder, say), a result pickle that runs code, even one we own: results are
    read from the task's JSON record only; a pickle alone says nothing (FAILED)."""
    pwned = tmp_path / "PWNED"
    folder = tmp_path / "slurm"
    folder.mkdir()
    record_job(
        tmp_path,
        {"job_id": str(DEAD_PID), "executor": "local", "folder": str(folder), "num_tasks": 1, "snapshot": None},
    )
    (folder / f"{DEAD_PID}_0_result.pkl").write_bytes(pickle.dumps(("success", _Payload(pwned))))
    assert main(["status", str(DEAD_PID), "--run-dir", str(tmp_path)]) == 0
    assert ": FAILED" in capsys.readouterr().out
    assert not pwned.exists()


def test_job_handle_reads_no_pickle_from_a_shared_log_dir(tmp_path: Path) -> None:
    """JobHandle's results come from the tasks' JSON records: a pickle (ours or planted) is never loaded, and a JSON
    record another user wrote (a shared log_dir) is ignored."""
    from hpcdist.launch.task import write_result

    pwned = tmp_path / "PWNED"
    (tmp_path / "55_0_result.pkl").write_bytes(pickle.dumps(("success", _Payload(pwned))))
    handle = JobHandle(SimpleNamespace(job_id="55"), executor="slurm", folder=tmp_path, num_tasks=1)
    assert handle._from_results(none="UNKNOWN") == "UNKNOWN"
    assert not pwned.exists()
    write_result(tmp_path, "55", 0, ("success", {"step": 3}))
    assert handle._from_results(none="UNKNOWN") == "COMPLETED"
    if os.getuid() == 0:  # a record planted by another user is theirs, not the job's
        os.lchown(tmp_path / "55_0_result.json", OTHER_UID, OTHER_UID)
        assert handle._from_results(none="UNKNOWN") == "UNKNOWN"


def test_status_of_a_run_dir_with_fifos_does_not_hang(tmp_path: Path) -> None:
    """`hpcdist status JOB --run-dir DIR` reads DIR's metrics.jsonl and restarts.json: FIFOs there (nobody writes)
    must not block it (before: it waited forever at the first read)."""
    for name in ("metrics.jsonl", "restarts.json", "jobs.jsonl"):
        os.mkfifo(tmp_path / name)
    code = (
        "import sys; from hpcdist.launch.records import find_job, run_summary\n"
        "print(run_summary(sys.argv[1], '77'))\n"
        "try:\n    find_job('77', sys.argv[1])\nexcept OSError as e:\n    print(e)\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert p.returncode == 0, p.stderr
    assert "no training step logged yet" in p.stdout and "jobs.jsonl is not a regular file" in p.stdout, p.stdout


# --------------------------------------------------------------------------------------------- item 11: Prometheus


def test_prometheus_listens_on_localhost_by_default(small_cfg, tmp_path: Path) -> None:
    """Default logging.prometheus.addr is 127.0.0.1: the metrics are not served to other hosts; addr chooses."""
    pytest.importorskip("prometheus_client")
    from hpcdist.metrics.prometheus import PrometheusExporter
    from tests.dist.harness import free_port

    port = free_port()
    exporter = PrometheusExporter(
        small_cfg(f"logging.prometheus.port={port}", run_dir=tmp_path), enabled=True, node=0, job="j", restarts=0
    )
    assert exporter.active
    bound = {c.laddr for c in _listening(port)}
    assert bound == {("127.0.0.1", port)}, bound
    exporter.close()  # the end of train(): the port and the server's thread are gone for what the process does next
    assert not _listening(port) and not [t for t in threading.enumerate() if "serve_forever" in t.name]
    with pytest.raises(ConfigError, match=r"logging.prometheus.addr: .*not an IP address"):
        small_cfg("logging.prometheus.addr=no such host; rm -rf", run_dir=tmp_path)


def _listening(port: int) -> list[Any]:
    import psutil

    return [c for c in psutil.Process().net_connections(kind="inet") if c.status == "LISTEN" and c.laddr[1] == port]


# --------------------------------------------------------------------------------------------- item 12: links


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    return victim


def test_failures_record_is_not_appended_through_a_link(tmp_path: Path) -> None:
    from hpcdist.fault.failures import record

    run = tmp_path / "run"
    run.mkdir()
    victim = _victim(tmp_path)
    (run / "failures.jsonl").symlink_to(victim)
    with pytest.raises(OSError, match=r"failures\.jsonl.* a link"):
        record(run, kind="exception", cause="boom", rank=0)
    assert victim.read_text() == "precious\n"


def test_jobs_record_is_not_appended_through_a_link(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    (tmp_path / "jobs.jsonl").symlink_to(victim)
    with pytest.raises(OSError, match=r"jobs\.jsonl.* a link"):
        record_job(tmp_path, {"job_id": "1", "executor": "local"})
    assert victim.read_text() == "precious\n"


def test_metrics_are_not_appended_through_a_link_nor_into_a_fifo(tmp_path: Path) -> None:
    from hpcdist.metrics.logger import MetricsLogger

    victim = _victim(tmp_path)
    (tmp_path / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(OSError, match=r"metrics\.jsonl.* a link"):
        MetricsLogger(tmp_path, enabled=True, tensorboard=False)
    assert victim.read_text() == "precious\n"
    (tmp_path / "metrics.jsonl").unlink()
    os.mkfifo(tmp_path / "metrics.jsonl")  # no reader: a plain open for writing would block forever
    with pytest.raises(OSError, match=r"metrics\.jsonl.* not a regular file"):
        MetricsLogger(tmp_path, enabled=True, tensorboard=False)


def test_an_append_only_file_of_another_user_is_refused(tmp_path: Path) -> None:
    _needs_root()
    from hpcdist.base.atomic import append_line

    theirs = tmp_path / "failures.jsonl"
    theirs.write_text("")
    os.chown(theirs, OTHER_UID, OTHER_UID)
    with pytest.raises(OSError, match=f"belongs to uid {OTHER_UID}"):
        append_line(theirs, "{}\n")
    assert theirs.read_text() == ""


def test_train_refuses_a_linked_metrics_file_before_starting(small_cfg, tmp_path: Path, capsys) -> None:
    """A link at an append-only name in the run dir: one line naming it and the fix, exit 2, before any step."""
    run = tmp_path / "run"
    run.mkdir()
    victim = _victim(tmp_path)
    (run / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(ConfigError, match=r"run.dir: .*metrics.jsonl.* is a link"):
        check_run_dir(small_cfg(run_dir=run))
    assert victim.read_text() == "precious\n"


def test_a_run_dir_that_is_another_users_link_is_refused(small_cfg, tmp_path: Path) -> None:
    """run.dir is a symlink another user made (pointing at a directory of ours, so the owner check on the target
    passes): refused. Our own link is followed as before."""
    _needs_root()
    mine = tmp_path / "mine"
    mine.mkdir()
    link = tmp_path / "shared-name"
    link.symlink_to(mine)
    check_run_dir(small_cfg(run_dir=link))  # our own link: fine
    os.lchown(link, OTHER_UID, OTHER_UID)
    with pytest.raises(ConfigError, match=rf"run.dir: .*shared-name.* is a link made by uid {OTHER_UID}"):
        check_run_dir(small_cfg(run_dir=link))
    with pytest.raises(ConfigError, match=rf"run.dir: .* is a link made by uid {OTHER_UID}"):
        check_run_dir(small_cfg(run_dir=link / "sub"))  # a link above it counts too


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
