"""The per-node health gate, ``hpcdist health``: stand-in ``nvidia-smi`` / ``dmesg`` scripts on
PATH, a fake sysfs tree, real run dirs. The gate must fail a sick node with the reason, pass a healthy one, and end
within its timeout whatever the tools do (hang, flood, print garbage)."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest

from hpcdist import cli
from hpcdist.diagnostics import gate as gate_mod
from hpcdist.diagnostics.gate import CHECKS, check_node, parse_xids
from hpcdist.fault.failures import primary_failure, read_failures
from hpcdist.fault.health import health_argv, read_verdicts, record_unhealthy
from hpcdist.launch import records

# the tool checks only: gpus/matmul import torch (seconds) and are covered once, below
TOOLS_ONLY = ("gpus", "matmul", "infiniband", "run_dir", "shm")
BUS = "00000000:3B:00.0"
HEALTHY_GPU = f"0, {BUS}, 0, No"
HEALTHY_REMAP = f"{BUS}, 0, 0"
XID_79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus."  # a stamp: ``[  12.3] ``


def stand_in(bin_dir: Path, name: str, body: str) -> None:
    """An executable ``bin_dir/name`` (a /bin/sh script) that answers like the real tool."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    path = bin_dir / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def nvidia_smi(bin_dir: Path, gpu: str = HEALTHY_GPU, remap: str = HEALTHY_REMAP, rc: int = 0) -> None:
    stand_in(
        bin_dir,
        "nvidia-smi",
        f'case "$1" in\n  --query-gpu=*) echo "{gpu}"; exit {rc};;\n'
        f'  --query-remapped-rows=*) echo "{remap}";;\n  *) exit 9;;\nesac',
    )


def tools(tmp_path: Path, *, dmesg: str = "[ 1.0] Linux version 6.1", **smi: str | int) -> dict[str, str]:
    """An environment whose PATH finds the stand-ins first (a healthy kernel log unless told otherwise)."""
    bin_dir = tmp_path / "bin"
    nvidia_smi(bin_dir, **smi)  # type: ignore[arg-type]
    stand_in(bin_dir, "dmesg", f"echo '{dmesg}'")
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}"}


def gate(env: dict[str, str], **kw: object) -> tuple[bool, dict[str, str], list[str]]:
    health = check_node(environ=env, skip=kw.pop("skip", TOOLS_ONLY), **kw)  # type: ignore[arg-type]
    return health.ok, health.checks, health.reasons


# ------------------------------------------------------------------------------------------------ nvidia-smi


def test_a_healthy_stand_in_passes(tmp_path: Path) -> None:
    ok, checks, reasons = gate(tools(tmp_path))
    assert ok and reasons == []
    assert checks["nvidia_smi"] == "ok" and checks["xid"] == "ok"
    assert checks["gpus"].startswith("skipped") and list(checks) == list(CHECKS)


@pytest.mark.parametrize(
    "smi, expected",
    [
        ({"gpu": f"0, {BUS}, 2, No"}, f"GPU 0 ({BUS}): 2 uncorrectable ECC error(s)"),
        ({"gpu": f"0, {BUS}, 0, Yes"}, "a retired memory page is pending"),
        ({"remap": f"{BUS}, Yes, No"}, "a row remapping is pending"),
        ({"remap": f"{BUS}, 0, 1"}, "row remapping failed"),
        # a GPU off the bus: nvidia-smi itself fails
        ({"gpu": f"Unable to determine the device handle for GPU {BUS}: Unknown Error", "rc": 15}, "exit 15"),
    ],
)
def test_a_stand_in_reporting_a_memory_error_makes_the_node_unhealthy(
    tmp_path: Path, smi: dict[str, str | int], expected: str
) -> None:
    ok, _, reasons = gate(tools(tmp_path, **smi))
    assert not ok
    assert len(reasons) == 1 and reasons[0].startswith("nvidia_smi: ") and expected in reasons[0], reasons


def test_unsupported_fields_are_not_failures(tmp_path: Path) -> None:
    # a GPU without ECC / row remapping prints [N/A]: nothing is known to be wrong
    ok, checks, _ = gate(tools(tmp_path, gpu=f"0, {BUS}, [N/A], [N/A]", remap=f"{BUS}, [N/A], [N/A]"))
    assert ok and checks["nvidia_smi"] == "ok"


def test_a_hardware_xid_in_the_kernel_log_makes_the_node_unhealthy(tmp_path: Path) -> None:
    app_fault = "[    9.0] NVRM: Xid (PCI:0000:3b:00): 13, pid=99, Graphics Exception"  # a user's bad kernel
    ok, _, reasons = gate(tools(tmp_path, dmesg=app_fault))
    assert ok, reasons
    now = int(float(Path("/proc/uptime").read_text().split()[0]))
    log = f"{app_fault}\n[{now - 60:>5}.1] {XID_79}\n[{now - 30:>5}.2] {XID_79}"
    ok, _, reasons = gate(tools(tmp_path / "b", dmesg=log))
    assert not ok and reasons == ["xid: Xid 79 on PCI:0000:3b:00 (2 time(s) in the kernel log's last 24 h)"]


def test_an_old_xid_is_not_recent() -> None:
    old, recent = f"[  100.5] {XID_79}", f"[ 90000.0] {XID_79}"
    assert parse_xids(old.encode(), uptime_s=100_000.0) == []  # a day and more ago: reset or repaired since
    assert len(parse_xids(f"{old}\n{recent}".encode(), uptime_s=100_000.0)) == 1
    assert len(parse_xids(XID_79.encode(), uptime_s=100_000.0)) == 1  # no stamp (dmesg -T): counted


@pytest.mark.parametrize(
    "gpu, expected",
    [
        ("garbage", "4 fields expected, got 1: 'garbage'"),
        (f"0, {BUS}, lots, No", "not a count: 'lots'"),
        (f"0, {BUS}, 0, maybe", "not Yes/No: 'maybe'"),
    ],
)
def test_garbage_output_is_a_clear_reason(tmp_path: Path, gpu: str, expected: str) -> None:
    ok, _, reasons = gate(tools(tmp_path, gpu=gpu))
    assert not ok and expected in reasons[0], reasons


def test_huge_output_is_cut_and_named(tmp_path: Path) -> None:
    env = tools(tmp_path)
    stand_in(tmp_path / "bin", "nvidia-smi", "yes '0, 1, 2, 3'")  # never stops printing
    start = time.monotonic()
    ok, _, reasons = gate(env, timeout_s=20)
    assert not ok and "nvidia-smi printed more than 256 KiB" in reasons[0], reasons
    assert time.monotonic() - start < 15  # cut at the cap, not at the timeout


def test_a_hanging_stand_in_is_bounded_by_the_timeout(tmp_path: Path) -> None:
    env = tools(tmp_path)
    # the child keeps the output pipe open after the script is killed: the whole session is killed
    stand_in(tmp_path / "bin", "nvidia-smi", "sleep 60 &\nwait")
    start = time.monotonic()
    ok, checks, _ = gate(env, timeout_s=2)
    elapsed = time.monotonic() - start
    assert not ok and "nvidia-smi did not answer within" in checks["nvidia_smi"], checks
    assert elapsed < 4, elapsed
    assert checks["xid"] == "ok"  # the other checks still answer


# ------------------------------------------------------------------------------------------------ InfiniBand


def fake_port(root: Path, hca: str, state: str, layer: str = "InfiniBand") -> None:
    port = root / "class" / "infiniband" / hca / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text(f"{state}\n")
    (port / "link_layer").write_text(f"{layer}\n")


def test_a_down_infiniband_port_fails_when_the_profile_uses_infiniband(tmp_path: Path) -> None:
    sysfs = tmp_path / "sys"
    fake_port(sysfs, "mlx5_0", "4: ACTIVE")
    fake_port(sysfs, "mlx5_1", "1: DOWN")
    fake_port(sysfs, "mlx5_2", "1: DOWN", layer="Ethernet")  # a RoCE storage NIC: not NCCL's
    env = {"PATH": os.environ.get("PATH", "")}
    skip = tuple(c for c in CHECKS if c != "infiniband")
    ok, _, reasons = gate(env, skip=skip, sysfs_root=sysfs, nccl_profile="ib_a100")
    assert not ok and reasons == ["infiniband: InfiniBand port(s) not ACTIVE: mlx5_1 port 1: 1: DOWN"]
    # an Ethernet profile expects no IB; neither does a job that turned IB off in its environment
    assert gate(env, skip=skip, sysfs_root=sysfs, nccl_profile="ethernet")[1]["infiniband"].startswith("skipped")
    off = {**env, "NCCL_IB_DISABLE": "1"}
    assert gate(off, skip=skip, sysfs_root=sysfs, nccl_profile="ib_a100")[1]["infiniband"].startswith("skipped")
    (sysfs / "class" / "infiniband" / "mlx5_1" / "ports" / "1" / "state").write_text("4: ACTIVE\n")
    assert gate(env, skip=skip, sysfs_root=sysfs, nccl_profile="ib_a100")[0]


def test_no_infiniband_is_a_failure_on_a_gpu_node_and_skipped_on_a_cpu_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CPU-only node (the sandbox, a laptop) runs gloo over TCP: the ib_a100 profile's InfiniBand is never used
    there (the README's sbatch lines with the default profile failed the gate on the sandbox before)."""
    env = {"PATH": os.environ.get("PATH", ""), "HPCDIST_NCCL_PROFILE": "ib_a100"}
    skip = tuple(c for c in CHECKS if c != "infiniband")
    dev = tmp_path / "dev"
    dev.mkdir()
    monkeypatch.setattr(gate_mod, "DEV", dev)
    sysfs = tmp_path / "sys"  # no class/infiniband at all
    assert gate(env, skip=skip, sysfs_root=sysfs, nccl_profile="ib_a100")[1]["infiniband"].startswith("skipped")
    (dev / "nvidia0").touch()
    assert gate(env, skip=skip, sysfs_root=sysfs, nccl_profile="ib_a100")[1]["infiniband"].startswith("fail")


def test_the_ib_reader_follows_no_link_out_of_sysfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "nvidia0").touch()  # a GPU node: there, no InfiniBand port is a failure
    monkeypatch.setattr(gate_mod, "DEV", tmp_path / "dev")
    sysfs, elsewhere = tmp_path / "sys", tmp_path / "elsewhere"
    fake_port(elsewhere, "mlx5_0", "4: ACTIVE")
    (sysfs / "class" / "infiniband").mkdir(parents=True)
    (sysfs / "class" / "infiniband" / "mlx5_0").symlink_to(elsewhere / "class" / "infiniband" / "mlx5_0")
    env = {"PATH": os.environ.get("PATH", "")}
    skip = tuple(c for c in CHECKS if c != "infiniband")
    ok, _, reasons = gate(env, skip=skip, sysfs_root=sysfs, nccl_profile="ib_a100")
    assert not ok and "lists no InfiniBand port" in reasons[0], reasons


# ------------------------------------------------------------------------------------------------ disk, GPUs


def test_a_run_dir_that_cannot_be_written_or_is_full_fails(tmp_path: Path) -> None:
    env = {"PATH": os.environ.get("PATH", "")}
    skip = tuple(c for c in CHECKS if c not in ("run_dir", "shm"))
    # /proc takes no new files, even from root (a chmod'ed directory would not stop root)
    ok, _, reasons = gate(env, skip=skip, run_dir="/proc/hpcdist-run")
    assert not ok and reasons[0].startswith("run_dir: /proc: cannot create a file there"), reasons
    ok, _, reasons = gate(env, skip=skip, run_dir=tmp_path, min_free_gb=1e9)
    assert not ok and "less than 1e+09 GiB (--min-free-gb)" in reasons[0], reasons
    ok, checks, _ = gate(env, skip=skip, run_dir=tmp_path / "new" / "run")
    assert ok and checks["run_dir"].startswith("ok (does not exist yet"), checks
    assert not list(tmp_path.iterdir())  # the probe left nothing behind, created nothing
    ok, _, reasons = gate(env, skip=skip, run_dir=tmp_path, min_shm_gb=1e9)
    assert not ok and reasons[0].startswith("shm: /dev/shm has"), reasons


def test_gpu_count_and_the_matmul_run_here(tmp_path: Path) -> None:
    """The one test importing torch: the matmul path runs everywhere (on the CPU without a GPU)."""
    import torch

    visible = torch.cuda.device_count()
    env = {"PATH": os.environ.get("PATH", "")}
    skip = ("nvidia_smi", "xid", "infiniband", "run_dir", "shm")
    (tmp_path / "driver" / "nvidia" / "gpus" / "0000:07:00.0").mkdir(parents=True)  # a node with a driver
    ok, checks, reasons = gate(env, skip=skip, gpus=visible + 1, proc_root=tmp_path)
    assert not ok and reasons == [f"gpus: {visible} GPU(s) visible, {visible + 1} requested"]
    assert checks["matmul"].startswith("ok (") and ("cpu" in checks["matmul"] or "cuda:0" in checks["matmul"])


def test_a_node_without_a_gpu_driver_skips_the_device_checks_without_importing_torch(tmp_path: Path) -> None:
    """The attempt loop runs the gate on every node before every attempt: on a CPU node (no NVIDIA driver) and a
    job that asked for no GPU there is nothing for gpus/matmul to test, and importing torch for them cost 2-11 s
    of every in-job recovery (docs/FAULTS.md). A node WITH a driver still runs them (below)."""
    import subprocess
    import sys

    code = (
        "import json, sys\n"
        "from hpcdist.diagnostics.gate import check_node\n"
        f"h = check_node(proc_root={str(tmp_path)!r}, skip=('nvidia_smi', 'xid', 'infiniband', 'run_dir', 'shm'))\n"
        "print(json.dumps([h.ok, h.checks['gpus'], h.checks['matmul'], 'torch' in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    ok, gpus, matmul, torch_imported = json.loads(out.stdout.strip().splitlines()[-1])
    assert ok and not torch_imported, out.stdout
    assert gpus == "skipped: no --gpus given and no NVIDIA driver on this node"
    assert matmul.startswith("skipped: no GPU on this node to test")


def test_a_node_with_a_gpu_driver_runs_the_device_checks(tmp_path: Path) -> None:
    (tmp_path / "driver" / "nvidia" / "gpus" / "0000:07:00.0").mkdir(parents=True)
    assert gate_mod.nvidia_driver_gpus(tmp_path) == 1 and gate_mod.nvidia_driver_gpus(tmp_path / "none") is None
    skip = ("nvidia_smi", "xid", "infiniband", "run_dir", "shm")
    ok, checks, _ = gate({"PATH": os.environ.get("PATH", "")}, skip=skip, proc_root=tmp_path, timeout_s=120)
    assert ok and checks["gpus"].startswith("skipped: no --gpus given ("), checks
    assert checks["matmul"].startswith("ok ("), checks


def _gate_in_a_fresh_interpreter(**kw: object) -> dict:
    """check_node in a new interpreter, so its device checks pay a cold ``import torch`` as on a node: the device
    checks and whether torch was imported. Leaves with os._exit (a device check may still be importing)."""
    import subprocess
    import sys

    code = (
        "import json, os, sys\n"
        "from hpcdist.diagnostics.gate import check_node\n"
        f"h = check_node(skip=('nvidia_smi', 'xid', 'infiniband', 'run_dir', 'shm'), **{kw!r})\n"
        "print(json.dumps(dict(ok=h.ok, gpus=h.checks['gpus'], matmul=h.checks['matmul'], seconds=h.seconds,\n"
        "                      torch='torch' in sys.modules)), flush=True)\n"
        "os._exit(0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_device_checks_have_their_own_bound_beyond_the_fast_checks(tmp_path: Path) -> None:
    """A cold ``import torch`` plus CUDA start-up takes longer than the fast checks' deadline on a busy node (many
    nodes reading torch from one shared file system at once): it must not make a healthy node "did not finish".
    The fast deadline here (0.2 s) is far below any torch import; the device bound (120 s) holds it."""
    (tmp_path / "driver" / "nvidia" / "gpus" / "0000:07:00.0").mkdir(parents=True)
    got = _gate_in_a_fresh_interpreter(proc_root=str(tmp_path), timeout_s=0.2, device_timeout_s=120.0)
    assert got["ok"] and got["matmul"].startswith("ok ("), got
    assert got["gpus"].startswith("skipped: no --gpus given ("), got
    # and the device bound is a bound: a device check past it fails, naming it
    got = _gate_in_a_fresh_interpreter(proc_root=str(tmp_path), timeout_s=60.0, device_timeout_s=0.2)
    assert not got["ok"] and got["seconds"] < 30, got
    assert got["gpus"] == "fail: did not finish within 0.2 s (--device-timeout: torch import, CUDA start-up)", got


def test_gpus_asked_of_the_scheduler_on_a_node_without_a_driver_fail_without_importing_torch(tmp_path: Path) -> None:
    """The attempt loop passes --gpus only when the job asked the scheduler for GPUs. A node with the NVIDIA device
    files but no driver loaded is a GPU node that lost its driver: it fails at once, without torch. A node with
    neither driver nor device files has no NVIDIA GPU at all (a CPU cluster with stand-in gres, like the SLURM
    sandbox): its device checks are skipped, not failed, or every job there would end "too few healthy nodes"."""
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "nvidia0").touch()  # the device file of a GPU (its driver's character device on a real node)
    (dev / "nvidiactl").touch()  # the driver's control device: not a GPU
    assert gate_mod.nvidia_device_files(dev) == 1
    got = _gate_in_a_fresh_interpreter(proc_root=str(tmp_path), dev_root=str(dev), gpus=8)
    assert not got["ok"] and not got["torch"], got
    assert got["gpus"] == (
        f"fail: {dev}/nvidia* exist but no NVIDIA driver is loaded (no driver/nvidia/gpus), 8 GPU(s) requested"
    ), got
    assert got["matmul"] == "skipped: no GPU to test (no NVIDIA driver on this node)", got
    bare = tmp_path / "bare"
    bare.mkdir()
    got = _gate_in_a_fresh_interpreter(proc_root=str(tmp_path), dev_root=str(bare), gpus=8)
    assert got["ok"] and not got["torch"], got
    assert got["gpus"].startswith(f"skipped: no NVIDIA driver and no {bare}/nvidia* device on this node"), got


# ------------------------------------------------------------------------------------------------ command


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(["health", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_command_prints_one_json_line_and_exits_0_1_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    env = tools(tmp_path)
    monkeypatch.setenv("PATH", env["PATH"])
    monkeypatch.delenv("HPCDIST_NCCL_PROFILE", raising=False)
    base = ["--json", "--skip", "gpus,matmul", "--run-dir", str(tmp_path / "run")]
    code, out, _ = run_cli(base, capsys)
    assert code == 0 and len(out.splitlines()) == 1
    doc = json.loads(out)
    assert set(doc) == {"host", "ok", "reasons", "checks", "seconds"} and doc["ok"] is True
    assert set(doc["checks"]) == set(CHECKS) and isinstance(doc["seconds"], float)

    nvidia_smi(tmp_path / "bin", gpu=f"0, {BUS}, 5, No")
    code, out, _ = run_cli([*base, "--record"], capsys)
    doc = json.loads(out)
    assert code == 1 and doc["ok"] is False and "5 uncorrectable ECC error(s)" in doc["reasons"][0]
    assert doc["checks"]["nvidia_smi"].startswith("fail: ")
    assert read_failures(tmp_path / "run")[0]["kind"] == "health"  # --record wrote the verdict

    code, out, _ = run_cli(["--skip", "gpus,matmul"], capsys)  # human lines
    assert code == 1 and "UNHEALTHY (1 check(s) failed)" in out and "nvidia_smi  fail: GPU 0" in out

    for bad, says in (
        (["--skip", "bogus"], "unknown check(s) bogus"),
        (["--nccl-profile", "nope"], "nccl profile 'nope': unknown"),
        (["--record"], "--record needs --run-dir"),
    ):
        code, out, err = run_cli(bad, capsys)
        assert code == 2 and out == "" and says in err and "Traceback" not in err, err
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["health", "--timeout", "0"])
    assert exit_info.value.code == 2


# ------------------------------------------------------------------------------------------------ record


def test_an_unhealthy_host_is_recorded_blamed_and_shown_by_status(tmp_path: Path) -> None:
    reasons = ["nvidia_smi: GPU 3: 2 uncorrectable ECC error(s) since the driver loaded"]
    rec = record_unhealthy(tmp_path, "node-b", reasons)
    assert rec["kind"] == "health" and rec["blame"] == [{"rank": None, "host": "node-b"}]
    # the restart policy excludes the blamed hosts of the primary failure: this record is it
    primary = primary_failure(read_failures(tmp_path))
    assert primary is not None and primary["blame"][0]["host"] == "node-b"
    summary = records.run_summary(tmp_path)
    assert f"unhealthy node node-b: failed the health gate: {reasons[0]}" in summary, summary


def test_verdicts_of_an_srun_are_read_per_host_and_a_silent_host_is_unhealthy(tmp_path: Path) -> None:
    argv = health_argv(gpus=8, run_dir=tmp_path, timeout_s=20)
    assert argv[1:7] == ["-m", "hpcdist", "health", "--json", "--timeout", "20"] and "--gpus" in argv
    good = json.dumps({"host": "a", "ok": True, "reasons": [], "checks": {}, "seconds": 1.0})
    bad = json.dumps({"host": "b", "ok": False, "reasons": ["xid: Xid 79"], "checks": {}, "seconds": 1.0})
    output = f"srun: warning: something\n{good}\n{{not json\n{bad}\n" + '{"host": 3, "ok": "yes"}\n'
    assert read_verdicts(output, ["a", "b", "c"]) == {
        "a": [],
        "b": ["xid: Xid 79"],
        "c": ["no verdict from the health gate (node down, not started or timed out)"],
    }


def test_xid_location_is_one_printable_line_and_the_reason_is_capped() -> None:
    """A forged kernel-log line cannot add lines or escapes to a reason, and 20,000 distinct Xids are a short one."""
    forged = b"[ 10.0] NVRM: Xid (PCI:0000:3b:00\n\x1b[2J\x1b[31mFAKE LINE\n): 79, pid=1\n"
    escaped = b"[ 11.0] NVRM: Xid (\x1b[2J\x1b[31m): 79, pid=1\n"
    reasons = parse_xids(forged + escaped)
    assert reasons == ["Xid 79 on \\x1b[2J\\x1b[31m (1 time(s) in the kernel log's last 24 h)"]
    many = b"".join(b"NVRM: Xid (PCI:0000:%05d): 79, pid=1\n" % i for i in range(20_000))
    capped = parse_xids(many)
    assert len(capped) == 17 and capped[-1] == "and 19984 more GPU/Xid pair(s) in the kernel log"
    assert len("; ".join(capped)) < 2000


def test_a_setsid_grandchild_holding_the_pipe_is_killed(tmp_path: Path) -> None:
    """A tool that hangs after starting a grandchild in its own session (outside the tool's process group): once the
    tool did not answer, nothing of ours holds the pipe any more."""
    pid_file = tmp_path / "grandchild.pid"
    tool = tmp_path / "tool"
    tool.write_text(f"#!/bin/sh\nsetsid sh -c 'echo $$ > {pid_file}; sleep 300' &\nsleep 300\n")
    tool.chmod(0o755)
    with pytest.raises(gate_mod._Fail, match="did not answer"):
        gate_mod.run_tool([str(tool)], timeout_s=1.5)
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{grandchild}/stat") as f:
                alive = f.read().rpartition(")")[2].split()[0] != "Z"
        except FileNotFoundError:
            alive = False
        if not alive:
            break
        time.sleep(0.1)
    else:
        os.kill(grandchild, 9)
        pytest.fail(f"the setsid grandchild {grandchild} still runs after the tool was killed")
