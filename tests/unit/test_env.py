"""hpcdist.env and the SLURM module it reads through (hpcdist.schedulers.slurm): nodelist expansion, rendezvous port,
DistEnv detection, process-group setup."""

import dataclasses
import datetime
import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpcdist import env as envmod
from hpcdist.env import (
    EXPORTED_VAR,
    DistEnv,
    destroy_process_group,
    export_environ,
    from_environ,
    init_process_group,
    port_from_job_id,
)
from hpcdist.schedulers.slurm import expand_nodelist, hostnames
from hpcdist.schedulers.slurm import facts as slurm

# ------------------------------------------------------------------------------------------------ helpers


@pytest.fixture
def no_scontrol(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty PATH so hostnames() cannot find scontrol; returns the PATH dir for fake tools."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    return bin_dir


# What torchrun gives every worker, and what export_environ writes.
TORCHRUN_NAMES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


@pytest.fixture
def clean_environ(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """os.environ without launcher variables (torchrun's, SLURM's, hpcdist's export record); everything a test
    adds or changes (export_environ writes os.environ) is undone afterwards."""
    for name in list(os.environ):
        if name.startswith(("SLURM_", "TORCHELASTIC_")) or name in (*TORCHRUN_NAMES, EXPORTED_VAR):
            monkeypatch.delenv(name)
    # export_environ adds names the test did not set: register them so monkeypatch removes them again
    for name in (*TORCHRUN_NAMES, EXPORTED_VAR):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return monkeypatch


def fake_scontrol(bin_dir: Path, body: str) -> Path:
    """Put an executable `scontrol` shell script with `body` on the test PATH."""
    script = bin_dir / "scontrol"
    script.write_text("#!/bin/sh\n" + body + "\n")
    script.chmod(0o755)
    return script


def slurm_step(**overrides: str) -> dict[str, str]:
    """Variables srun gives task 13 of a 4-node x 8-task step (plus the batch job's own variables)."""
    environ = {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "gpu[010-013]",
        "SLURM_JOB_NUM_NODES": "4",
        "SLURM_NNODES": "4",
        "SLURM_NTASKS": "32",
        "SLURM_TASKS_PER_NODE": "8(x4)",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NODELIST": "gpu[010-013]",
        "SLURM_STEP_NUM_NODES": "4",
        "SLURM_STEP_NUM_TASKS": "32",
        "SLURM_STEP_TASKS_PER_NODE": "8(x4)",
        "SLURM_PROCID": "13",
        "SLURM_LOCALID": "5",
        "SLURM_NODEID": "1",
    }
    environ.update(overrides)
    return {k: v for k, v in environ.items() if v is not None}


def sbatch_script() -> dict[str, str]:
    """Variables of a batch script on the first node of a 4-node job, before any srun."""
    return {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "gpu[010-013]",
        "SLURM_JOB_NUM_NODES": "4",
        "SLURM_NNODES": "4",
        "SLURM_NTASKS": "32",
        "SLURM_TASKS_PER_NODE": "8(x4)",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
    }


def torchrun_vars(**overrides: str) -> dict[str, str]:
    """Variables torchrun gives worker 3 on the second of two 2-process nodes."""
    environ = {
        "TORCHELASTIC_RUN_ID": "none",
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2",
        "MASTER_ADDR": "head-node",
        "MASTER_PORT": "29400",
    }
    environ.update(overrides)
    return environ


def make_env(**overrides: object) -> DistEnv:
    fields: dict[str, object] = dict(
        rank=0,
        local_rank=0,
        world_size=1,
        local_world_size=1,
        node_rank=0,
        num_nodes=1,
        master_addr="127.0.0.1",
        master_port=29500,
        device="cpu",
        backend="gloo",
        launcher="single",
        job_id=None,
        hostname="h",
    )
    fields.update(overrides)
    return DistEnv(**fields)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------- expand_nodelist

EXPANSIONS = [
    ("gpu[001-004,007],login2", ["gpu001", "gpu002", "gpu003", "gpu004", "gpu007", "login2"]),
    ("n[08-11]", ["n08", "n09", "n10", "n11"]),
    ("x[9-10]", ["x9", "x10"]),
    ("a[001-2]", ["a001", "a002"]),  # padding follows the low end, as in scontrol
    ("a[1-2]-ib[0-1]", ["a1-ib0", "a1-ib1", "a2-ib0", "a2-ib1"]),
    ("n[1-2],m[3-4]x[5-6]", ["n1", "n2", "m3x5", "m3x6", "m4x5", "m4x6"]),
    ("node1", ["node1"]),
    ("node1,node2,login-3", ["node1", "node2", "login-3"]),
    ("gpu[3]", ["gpu3"]),
    ("[1-2]", ["1", "2"]),
    ("r1n[1,3,5-6]", ["r1n1", "r1n3", "r1n5", "r1n6"]),
    ("a,,b", ["a", "b"]),  # scontrol skips empty entries too
    ("  a  b ", ["a", "b"]),
    ("a\tb", ["a", "b"]),  # a tab separates, like a blank (a newline does not: refused below)
    ("a[1-2][3-4]", ["a13", "a14", "a23", "a24"]),
    # with 3+ groups scontrol varies the last fastest, then the first, second, ...
    ("a[1-2]b[1-2]c[1-2]", ["a1b1c1", "a1b1c2", "a2b1c1", "a2b1c2", "a1b2c1", "a1b2c2", "a2b2c1", "a2b2c2"]),
    (
        "r[1-3]n[1-2]g[0-1]",
        [
            "r1n1g0",
            "r1n1g1",
            "r2n1g0",
            "r2n1g1",
            "r3n1g0",
            "r3n1g1",
            "r1n2g0",
            "r1n2g1",
            "r2n2g0",
            "r2n2g1",
            "r3n2g0",
            "r3n2g1",
        ],
    ),
    (
        "a[1-2]b[1-2]c[1-2]d[1]",
        ["a1b1c1d1", "a2b1c1d1", "a1b2c1d1", "a2b2c1d1", "a1b1c2d1", "a2b1c2d1", "a1b2c2d1", "a2b2c2d1"],
    ),
]


@pytest.mark.parametrize(("nodelist", "expected"), EXPANSIONS)
def test_expand_nodelist(nodelist: str, expected: list[str]) -> None:
    assert expand_nodelist(nodelist) == expected


@pytest.mark.parametrize(
    ("nodelist", "message"),
    [
        ("", "empty nodelist"),
        ("   ", "empty nodelist"),
        (",", "no host names"),
        ("gpu[1-4", "unclosed '\\['"),
        ("gpu1-4]", "unbalanced '\\]'"),
        ("gpu[[1-2]]", "nested"),
        ("gpu[5-2]", "descending range '5-2'"),
        ("gpu[]", "empty brackets"),
        ("gpu[1-x]", "bad item '1-x'"),
        ("gpu[a]", "bad item 'a'"),
        ("gpu[1,,2]", "bad item ''"),
        ("gpu[0-99999999]", "more than"),
        ("a[0-65536]", "more than 65536 values"),  # scontrol: "Too many hosts in range"
        # scontrol refuses a name that goes on after its last bracket group, and newlines
        ("a[1-3]b", "continues after its last"),
        ("[1-2]a", "continues after its last"),
        ("a[1-2]b[1-2]c", "continues after its last"),
        ("a[1-2]\n", r"control character '\\n' at position 6"),
        ("a[1-2]\nb", "control character"),
        ("a\nb", "control character"),  # scontrol makes one host named "a\nb" of it
        ("a\rb,c", r"control character '\\r' at position 1"),
        ("gpu[001-002, 007]", "bad item ' 007'"),  # scontrol: gpu0007 (the blank counts in the padding)
    ],
)
def test_expand_nodelist_rejects_malformed(nodelist: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        expand_nodelist(nodelist)


# -------------------------------------------------------------------------------------------- hostnames


def test_hostnames_without_scontrol_uses_parser(no_scontrol: Path) -> None:
    assert shutil.which("scontrol") is None
    assert hostnames("gpu[001-002],login2") == ["gpu001", "gpu002", "login2"]


def test_hostnames_prefers_working_scontrol(no_scontrol: Path) -> None:
    # Output the parser would never produce proves scontrol's answer is the one returned.
    fake_scontrol(no_scontrol, 'echo "from-scontrol-1"; echo "from-scontrol-2"')
    assert hostnames("gpu[1-2]") == ["from-scontrol-1", "from-scontrol-2"]


@pytest.mark.parametrize(
    "body",
    [
        'echo "scontrol: error: Unable to process configuration file" >&2; exit 1',
        'echo "partial-output"; exit 1',
        # scontrol 22.05 exits 0 on a list it cannot parse, with nothing on stdout ...
        'echo "Invalid hostlist: $3" >&2; exit 0',
        # ... and echoes garbage for an unclosed bracket.
        'echo "gpu]"; exit 0',
    ],
)
def test_hostnames_falls_back_when_scontrol_fails(no_scontrol: Path, body: str) -> None:
    fake_scontrol(no_scontrol, body)
    assert hostnames("gpu[1-2]") == ["gpu1", "gpu2"]
    with pytest.raises(ValueError, match="unclosed"):
        hostnames("gpu[1-2")


def test_hostnames_survives_hanging_scontrol(no_scontrol: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_scontrol(no_scontrol, "exec sleep 30")  # exec: the timeout kill reaches the sleeping process
    monkeypatch.setattr(slurm, "SCONTROL_TIMEOUT_S", 0.2)
    assert hostnames("n[1-2]") == ["n1", "n2"]


def test_hostnames_empty_is_an_error_not_the_jobs_nodelist(no_scontrol: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given no list, real scontrol expands $SLURM_JOB_NODELIST; an empty input must not silently do that.
    fake_scontrol(no_scontrol, 'echo "job-node-1"')
    monkeypatch.setenv("SLURM_JOB_NODELIST", "job-node-1")
    with pytest.raises(ValueError, match="empty nodelist"):
        hostnames("  ")


@pytest.fixture(scope="module")
def scontrol(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A working ``scontrol`` (SLURM_CONF set for this module's tests), or a skip saying why not."""
    exe = shutil.which("scontrol")
    if exe is None:
        reason = "scontrol is not on PATH (install slurm-wlm: .ci/install-slurm)"
        print(reason)
        pytest.skip(reason)
    # scontrol needs a readable slurm.conf even to expand host lists; four lines are enough (FACTS.md)
    conf = tmp_path_factory.mktemp("slurm") / "slurm.conf"
    conf.write_text("ClusterName=t\nSlurmctldHost=localhost\nNodeName=n1 CPUs=1\nPartitionName=p Nodes=n1\n")
    mp = pytest.MonkeyPatch()
    mp.setenv("SLURM_CONF", str(conf))
    try:
        # A SLURM_CONF naming a missing file makes scontrol retry for 60 s: keep the probe short.
        probe = subprocess.run([exe, "show", "hostnames", "n[1-2]"], capture_output=True, text=True, timeout=3)
    except subprocess.TimeoutExpired:
        reason = "scontrol does not work here: no answer within 3 s (missing slurm.conf?)"
    else:
        works = probe.returncode == 0 and probe.stdout.split() == ["n1", "n2"]
        reason = "" if works else f"scontrol does not work here (exit {probe.returncode}): {probe.stderr.strip()[:200]}"
    if reason:
        mp.undo()
        print(reason)
        pytest.skip(reason)
    yield exe
    mp.undo()


def _scontrol(exe: str, nodelist: str) -> list[str] | None:
    """scontrol's expansion, or None where it refuses the list (22.05 exits 0 and says "Invalid hostlist") or
    complains: a bad range in a group before the last of 3+ is reported ("error: ... Invalid range") and then
    dropped with the names it would have made, which the parser refuses instead."""
    out = subprocess.run([exe, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=10)
    said = out.stdout + out.stderr
    refused = out.returncode != 0 or "Invalid hostlist" in said or "error:" in said or not out.stdout.strip()
    return None if refused else out.stdout.splitlines()


def _parser(nodelist: str) -> list[str] | None:
    try:
        return expand_nodelist(nodelist)
    except ValueError:
        return None


def test_scontrol_agrees_with_parser(scontrol: str) -> None:
    for nodelist, expected in EXPANSIONS:
        if " " in nodelist:
            continue  # one argv word per list in real use
        assert _scontrol(scontrol, nodelist) == expected == expand_nodelist(nodelist), nodelist


# lists scontrol refuses, which the parser used to accept (a name after the last group, a newline after a group)
# or expanded in another order; scontrol's quirks the parser refuses on purpose ("a\nb" as one host, blanks counted
# in the padding) are not compared
@pytest.mark.parametrize(
    "nodelist",
    [
        "a[1-3]b",
        "[1-2]a",
        "a[1-2]-",
        "a[1-2]\n",
        "a[1-2]\nb",
        "a[0-65536]",
        "a[5-2]",
        "a[]",
        "a[1,,2]",
        "a[1-2-3]",
        "a[[1-2]]",
        "a[1-2]]",
    ],
)
def test_parser_refuses_what_scontrol_refuses(scontrol: str, nodelist: str) -> None:
    assert _scontrol(scontrol, nodelist) is None
    with pytest.raises(ValueError):
        expand_nodelist(nodelist)


_GROUP = st.lists(
    st.tuples(st.integers(0, 12), st.integers(0, 3), st.integers(1, 2)).map(
        lambda t: f"{t[0]:0{t[2]}d}" if t[1] == 0 else f"{t[0]:0{t[2]}d}-{t[0] + t[1] - (t[1] == 3) * 20}"
    ),  # mostly ascending ranges; sometimes a descending one (both refuse it)
    min_size=1,
    max_size=3,
).map(lambda items: f"[{','.join(items)}]")
_PREFIX = st.text("abn-", max_size=3).filter(lambda t: not t.startswith("-"))  # "-x" is an option to scontrol
_ENTRY = st.tuples(_PREFIX, st.lists(st.tuples(_GROUP, st.text("bx-", max_size=2)), max_size=4), st.booleans()).map(
    # prefix, then groups with literals between them; the literal after the last group only when the flag says so
    lambda t: t[0] + "".join(g + lit for g, lit in t[1][:-1]) + (t[1][-1][0] + t[1][-1][1] * t[2] if t[1] else "")
)
_NODELISTS = st.lists(_ENTRY.filter(bool), min_size=1, max_size=3).map(",".join)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(nodelist=_NODELISTS)
def test_parser_matches_scontrol_on_generated_lists(scontrol: str, nodelist: str) -> None:
    """Bracket groups 1-4 per name, literals between them, sometimes a name after the last group or a
    descending range; the parser's names (in order) or refusal equal scontrol's."""
    assert _parser(nodelist) == _scontrol(scontrol, nodelist), nodelist


# ---------------------------------------------------------------------------------------------- port


def test_port_is_deterministic_and_in_range() -> None:
    ids = [str(n) for n in range(1, 3000, 7)] + ["123_4", "98765432_17", "abc", "0"]
    for job_id in ids:
        port = port_from_job_id(job_id)
        assert port == port_from_job_id(job_id)
        assert 20000 <= port < 40000
    assert all(3000 <= port_from_job_id(j, base=3000, span=10) < 3010 for j in ids)


def test_port_separates_neighbouring_jobs_and_array_tasks() -> None:
    assert port_from_job_id("1000") != port_from_job_id("1001")
    assert port_from_job_id("123_4") != port_from_job_id("123_5")
    assert port_from_job_id("123_4") == 20000 + 1234


def test_port_without_job_id_is_torch_default() -> None:
    assert port_from_job_id(None) == 29500
    assert port_from_job_id("") == 29500


@pytest.mark.parametrize(("base", "span"), [(0, 10), (60000, 6000), (20000, 0)])
def test_port_rejects_bad_range(base: int, span: int) -> None:
    with pytest.raises(ValueError, match="port range"):
        port_from_job_id("1", base=base, span=span)


# ------------------------------------------------------------------------------------------ from_environ


def test_slurm_step(no_scontrol: Path) -> None:
    e = from_environ(slurm_step(), cuda_available=False)
    assert (e.rank, e.local_rank, e.world_size, e.local_world_size) == (13, 5, 32, 8)
    assert (e.node_rank, e.num_nodes) == (1, 4)
    assert e.master_addr == "gpu010"
    assert e.master_port == port_from_job_id("4242") != 29500
    assert (e.launcher, e.job_id) == ("slurm", "4242")
    assert e.is_distributed and not e.is_main
    assert e.hostname == socket.gethostname()


def test_slurm_step_on_part_of_the_allocation_uses_step_nodes(no_scontrol: Path) -> None:
    environ = slurm_step(
        SLURM_STEP_NODELIST="gpu[012-013]",
        SLURM_STEP_NUM_NODES="2",
        SLURM_STEP_NUM_TASKS="16",
        SLURM_STEP_TASKS_PER_NODE="8(x2)",
    )
    e = from_environ(environ, cuda_available=False)
    assert (e.master_addr, e.world_size, e.num_nodes) == ("gpu012", 16, 2)


def test_slurm_array_task_and_explicit_master(no_scontrol: Path) -> None:
    e = from_environ(slurm_step(SLURM_ARRAY_TASK_ID="7"), cuda_available=False)
    assert e.job_id == "4242_7"
    assert e.master_port == port_from_job_id("4242_7")
    e = from_environ(slurm_step(MASTER_ADDR="10.0.0.9", MASTER_PORT="31000"), cuda_available=False)
    assert (e.master_addr, e.master_port) == ("10.0.0.9", 31000)


def test_slurm_job_level_variables_and_uneven_nodes(no_scontrol: Path) -> None:
    # Older or minimal step environments: only SLURM_NTASKS / SLURM_TASKS_PER_NODE, and a short last node.
    environ = slurm_step(SLURM_PROCID="4", SLURM_LOCALID="0", SLURM_NODEID="2", SLURM_NTASKS="5")
    for name in ("SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE", "SLURM_STEP_NUM_NODES", "SLURM_STEP_NODELIST"):
        del environ[name]
    environ.update(SLURM_TASKS_PER_NODE="2(x2),1", SLURM_JOB_NUM_NODES="3", SLURM_JOB_NODELIST="c[1-3]")
    e = from_environ(environ, cuda_available=False)
    assert (e.rank, e.world_size, e.node_rank, e.num_nodes, e.local_world_size) == (4, 5, 2, 3, 1)
    assert e.master_addr == "c1"
    environ.update(SLURM_TASKS_PER_NODE="2,2,1")
    assert from_environ(environ, cuda_available=False).local_world_size == 1


def test_torchrun() -> None:
    e = from_environ(torchrun_vars(), cuda_available=False)
    assert (e.rank, e.local_rank, e.world_size, e.local_world_size) == (3, 1, 4, 2)
    assert (e.node_rank, e.num_nodes) == (1, 2)
    assert (e.master_addr, e.master_port) == ("head-node", 29400)
    assert (e.launcher, e.job_id) == ("torchrun", None)


def test_rank_variables_without_torchelastic_count_as_torchrun() -> None:
    e = from_environ({"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}, cuda_available=False)
    assert (e.launcher, e.rank, e.world_size, e.local_world_size, e.num_nodes) == ("torchrun", 1, 2, 2, 1)


def test_torchrun_inside_slurm_wins(no_scontrol: Path) -> None:
    # srun starts one torchrun per node; its workers inherit the step's SLURM_* variables.
    environ = {**slurm_step(SLURM_PROCID="1", SLURM_LOCALID="0"), **torchrun_vars()}
    e = from_environ(environ, cuda_available=False)
    assert (e.launcher, e.rank, e.world_size, e.master_addr) == ("torchrun", 3, 4, "head-node")
    assert e.job_id == "4242"


@pytest.mark.parametrize("step_id", [None, "-5", "4294967291"])  # unset, or the batch step's special id
def test_sbatch_script_without_srun_is_single(step_id: str | None) -> None:
    environ = sbatch_script()
    if step_id is not None:
        environ["SLURM_STEP_ID"] = step_id
    e = from_environ(environ, cuda_available=False)
    assert (e.launcher, e.rank, e.world_size, e.num_nodes) == ("single", 0, 1, 1)
    assert not e.is_distributed and e.is_main
    assert e.job_id == "4242"


def test_plain_environment_is_single() -> None:
    e = from_environ({}, cuda_available=False)
    assert e == make_env(hostname=socket.gethostname())
    assert from_environ({"MASTER_PORT": "12345"}, cuda_available=False).master_port == 12345


@pytest.mark.parametrize(
    ("environ", "device", "backend"),
    [
        (slurm_step(), "cuda:5", "nccl"),
        (torchrun_vars(), "cuda:1", "nccl"),
        ({}, "cuda:0", "nccl"),
    ],
)
def test_device_and_backend(no_scontrol: Path, environ: dict[str, str], device: str, backend: str) -> None:
    gpu = from_environ(environ, cuda_available=True)
    assert (gpu.device, gpu.backend) == (device, backend)
    assert gpu.torch_device() == torch.device(device)
    cpu = from_environ(environ, cuda_available=False)
    assert (cpu.device, cpu.backend, cpu.torch_device()) == ("cpu", "gloo", torch.device("cpu"))


@pytest.mark.parametrize(("count", "device"), [(8, "cuda:5"), (1, "cuda:0"), (4, None)])
def test_device_index_follows_visible_gpus(
    no_scontrol: Path, monkeypatch: pytest.MonkeyPatch, count: int, device: str | None
) -> None:
    # One GPU visible per task (srun --gpus-per-task=1) means ours is cuda:0, not cuda:<local_rank>.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    if device is None:
        with pytest.raises(ValueError, match="local_rank=5 but only 4 GPUs"):
            from_environ(slurm_step())
    else:
        assert from_environ(slurm_step()).device == device


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        (slurm_step(SLURM_PROCID="abc"), "SLURM_PROCID='abc' is not an integer"),
        (slurm_step(SLURM_LOCALID="-1"), "SLURM_LOCALID='-1' must be >= 0"),
        (slurm_step(SLURM_NODEID="1.0"), "SLURM_NODEID='1.0' is not an integer"),
        (slurm_step(SLURM_STEP_NUM_TASKS="lots"), "SLURM_STEP_NUM_TASKS='lots' is not an integer"),
        (slurm_step(SLURM_STEP_TASKS_PER_NODE="8(x)"), "SLURM_STEP_TASKS_PER_NODE"),
        (slurm_step(MASTER_PORT="http"), "MASTER_PORT='http' is not an integer"),
        (slurm_step(SLURM_STEP_ID="batch", SLURM_STEP_NUM_TASKS=""), "SLURM_STEP_ID='batch' is not an integer"),
        (slurm_step(SLURM_STEP_NODELIST="gpu[1-"), "SLURM_STEP_NODELIST: unclosed"),
        (torchrun_vars(RANK="x"), "RANK='x' is not an integer"),
        (torchrun_vars(WORLD_SIZE="0"), "WORLD_SIZE='0' must be >= 1"),
        (torchrun_vars(GROUP_RANK="one"), "GROUP_RANK='one' is not an integer"),
        ({"TORCHELASTIC_RUN_ID": "r", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}, "RANK is not set"),
        ({"MASTER_PORT": "29_500x"}, "MASTER_PORT='29_500x' is not an integer"),
    ],
)
def test_bad_values_name_the_variable(no_scontrol: Path, environ: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        from_environ(environ, cuda_available=False)


def test_all_bad_values_are_reported_at_once(no_scontrol: Path) -> None:
    with pytest.raises(ValueError) as info:
        from_environ(slurm_step(SLURM_PROCID="a", SLURM_LOCALID="b"), cuda_available=False)
    assert "SLURM_PROCID='a'" in str(info.value) and "SLURM_LOCALID='b'" in str(info.value)


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        (slurm_step(SLURM_PROCID="32"), "rank=32 must be in"),
        (slurm_step(SLURM_LOCALID="8"), "local_rank=8 must be in"),
        (slurm_step(SLURM_NODEID="4"), "SLURM_NODEID=4 but SLURM_STEP_TASKS_PER_NODE"),
        (torchrun_vars(RANK="4"), "rank=4 must be in"),
        (torchrun_vars(GROUP_RANK="2"), "node_rank=2 must be in"),
    ],
)
def test_inconsistent_values_are_rejected(no_scontrol: Path, environ: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        from_environ(environ, cuda_available=False)


def test_inconsistency_error_shows_the_variables(no_scontrol: Path) -> None:
    with pytest.raises(ValueError, match=r"SLURM_PROCID=32.*SLURM_STEP_NUM_TASKS=32"):
        from_environ(slurm_step(SLURM_PROCID="32"), cuda_available=False)


def test_from_environ_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(("SLURM_", "TORCHELASTIC_")) or name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("MASTER_PORT", "23456")
    assert from_environ(cuda_available=False).master_port == 23456


# ----------------------------------------------------------------------------------------- export_environ


def test_export_gives_a_slurm_task_torchruns_variables(no_scontrol: Path, clean_environ: pytest.MonkeyPatch) -> None:
    # srun sets SLURM_PROCID / SLURM_LOCALID only; DeepSpeed asserts LOCAL_RANK, env:// reads MASTER_ADDR/PORT
    for name, value in slurm_step().items():
        clean_environ.setenv(name, value)
    e = from_environ(cuda_available=False)
    changed = export_environ(e)
    want = {
        "RANK": "13",
        "LOCAL_RANK": "5",
        "WORLD_SIZE": "32",
        "LOCAL_WORLD_SIZE": "8",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "4",
        "MASTER_ADDR": "gpu010",
        "MASTER_PORT": str(port_from_job_id("4242")),
    }
    assert changed == want
    assert {name: os.environ[name] for name in TORCHRUN_NAMES} == want
    # a later from_environ in this process (or in a child that inherits os.environ) resolves the same DistEnv,
    # still as a SLURM task, not as torchrun
    assert from_environ(cuda_available=False) == e and e.launcher == "slurm"
    assert from_environ(dict(os.environ), cuda_available=False) == e
    assert export_environ(e) == {}  # idempotent


def _uneven_slurm() -> dict[str, str]:
    environ = slurm_step(SLURM_PROCID="4", SLURM_LOCALID="0", SLURM_NODEID="2", SLURM_NTASKS="5")
    for name in ("SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE", "SLURM_STEP_NUM_NODES", "SLURM_STEP_NODELIST"):
        del environ[name]
    return {**environ, "SLURM_TASKS_PER_NODE": "2(x2),1", "SLURM_JOB_NUM_NODES": "3", "SLURM_JOB_NODELIST": "c[1-3]"}


@pytest.mark.parametrize(
    "environ",
    [
        slurm_step(),
        slurm_step(MASTER_ADDR="10.0.0.1", MASTER_PORT="23456"),
        _uneven_slurm(),  # last node short: node_rank / local_world_size not derivable from RANK alone
        slurm_step(RANK="7"),  # a lone stale RANK does not make torchrun; it is overwritten
        {},
        {"MASTER_PORT": "12345", "MASTER_ADDR": "somewhere"},  # single ignores MASTER_ADDR: overwritten
        sbatch_script(),
        torchrun_vars(),
        {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"},  # torchrun-like launcher without the rest
    ],
    ids=[
        "srun",
        "srun-master",
        "srun-uneven",
        "srun-stale-rank",
        "single",
        "single-port",
        "sbatch",
        "torchrun",
        "rank-vars",
    ],
)
def test_from_environ_after_export_is_the_same(
    no_scontrol: Path, clean_environ: pytest.MonkeyPatch, environ: dict[str, str]
) -> None:
    for name, value in environ.items():
        clean_environ.setenv(name, value)
    before = from_environ(cuda_available=False)
    export_environ(before)
    assert all(os.environ[name] for name in TORCHRUN_NAMES)
    assert from_environ(cuda_available=False) == before
    for cuda in (True, False):  # the device follows the same local rank
        assert from_environ(cuda_available=cuda) == from_environ(environ, cuda_available=cuda)


def test_export_warns_before_overwriting_a_different_value(no_scontrol: Path, caplog: pytest.LogCaptureFixture) -> None:
    environ = slurm_step(LOCAL_RANK="7", MASTER_PORT="")  # LOCAL_RANK alone is not torchrun's: slurm's 5 wins
    e = from_environ(environ, cuda_available=False)
    with caplog.at_level("WARNING", logger="hpcdist.env"):
        export_environ(e, environ)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "LOCAL_RANK=7 in the environment differs from DistEnv's 5" in warned[0], warned
    assert environ["LOCAL_RANK"] == "5" and environ["MASTER_PORT"] == str(e.master_port)  # empty = unset: quiet
    caplog.clear()
    with caplog.at_level("WARNING", logger="hpcdist.env"):
        export_environ(e, environ)
    assert not caplog.records


def test_exported_values_changed_by_another_launcher_count_again(no_scontrol: Path) -> None:
    environ = slurm_step()
    export_environ(from_environ(environ, cuda_available=False), environ)
    # e.g. a test harness or DeepSpeed's launcher started in the task sets its own ranks: they are not ours anymore
    environ.update(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", GROUP_RANK="0", GROUP_WORLD_SIZE="1")
    e = from_environ(environ, cuda_available=False)
    assert (e.launcher, e.rank, e.world_size, e.num_nodes) == ("torchrun", 1, 2, 1)
    # under torchrun its variables decide, even where they equal an inherited export record
    environ = slurm_step()
    export_environ(from_environ(environ, cuda_available=False), environ)
    environ["TORCHELASTIC_RUN_ID"] = "none"
    e = from_environ(environ, cuda_available=False)
    assert (e.launcher, e.rank, e.world_size) == ("torchrun", 13, 32)


def test_task_of_a_nested_srun_resolves_its_own_step(no_scontrol: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A task started by srun from an exporting rank inherits the export; it is that task's SLURM step that counts
    (including the step's first node as the rendezvous host), and its own export replaces the parent's quietly."""
    parent = slurm_step()
    export_environ(from_environ(parent, cuda_available=False), parent)
    child = {
        **parent,
        **slurm_step(
            SLURM_STEP_ID="1",
            SLURM_STEP_NODELIST="gpu012",
            SLURM_STEP_NUM_NODES="1",
            SLURM_STEP_NUM_TASKS="2",
            SLURM_STEP_TASKS_PER_NODE="2",
            SLURM_PROCID="1",
            SLURM_LOCALID="1",
            SLURM_NODEID="0",
        ),
    }
    e = from_environ(child, cuda_available=False)
    assert (e.launcher, e.rank, e.local_rank, e.world_size, e.master_addr) == ("slurm", 1, 1, 2, "gpu012")
    with caplog.at_level("WARNING", logger="hpcdist.env"):
        export_environ(e, child)
    assert not caplog.records
    assert (child["RANK"], child["WORLD_SIZE"], child["MASTER_ADDR"]) == ("1", "2", "gpu012")
    assert from_environ(child, cuda_available=False) == e


def test_torchrun_export_leaves_no_record(clean_environ: pytest.MonkeyPatch) -> None:
    environ = torchrun_vars(**{EXPORTED_VAR: '{"RANK": "0"}'})  # stale record inherited from a parent
    e = from_environ(environ, cuda_available=False)
    assert export_environ(e, environ) == {}
    assert EXPORTED_VAR not in environ
    assert from_environ(environ, cuda_available=False) == e


def test_garbled_export_record_is_ignored(no_scontrol: Path) -> None:
    for record in ("{", "[1]", '{"RANK": 3}'):
        environ = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", EXPORTED_VAR: record}
        assert from_environ(environ, cuda_available=False).launcher == "torchrun"


# ---------------------------------------------------------------------------------------------- DistEnv


def test_distenv_is_frozen_and_validated() -> None:
    e = make_env()
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.rank = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match="launcher='mpi'"):
        make_env(launcher="mpi")
    with pytest.raises(ValueError, match="master_port=70000"):
        make_env(master_port=70000)


# ---------------------------------------------------------------------------------------- process group


def test_init_process_group_single_process_exports_but_joins_nothing(clean_environ: pytest.MonkeyPatch) -> None:
    def must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("init_process_group must not be called for world_size 1")

    clean_environ.setattr(dist, "init_process_group", must_not_run)
    init_process_group(from_environ({}, cuda_available=False))
    assert not dist.is_initialized()
    # DeepSpeed asserts LOCAL_RANK even in one process: torchrun's variables are there all the same
    assert {name: os.environ[name] for name in TORCHRUN_NAMES} == {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }


def test_init_process_group_passes_env_to_torch(clean_environ: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, object]] = []
    monkeypatch = clean_environ
    monkeypatch.setenv("MASTER_PORT", "1111")  # stale: the DistEnv is what every rank agreed on
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: calls.append(kwargs))
    # rank 1 first waits for rank 0's store: there is no host n1 here, so without this it polls for the full 60 s
    waited: list[tuple[object, ...]] = []
    monkeypatch.setattr(envmod, "_wait_for_master", lambda *args: waited.append(args))
    e = make_env(rank=1, world_size=2, local_world_size=2, local_rank=1, master_addr="n1", master_port=24000)
    init_process_group(e, timeout_s=60)
    assert waited == [("n1", 24000, 60)]
    assert calls == [
        dict(
            backend="gloo",
            init_method="env://",
            rank=1,
            world_size=2,
            timeout=datetime.timedelta(seconds=60),
        )
    ]
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("n1", "24000")
    assert (os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"]) == ("1", "1", "2")


def test_init_process_group_is_idempotent(clean_environ: pytest.MonkeyPatch) -> None:
    monkeypatch = clean_environ
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: pytest.fail("initialized twice"))
    init_process_group(make_env(rank=1, world_size=2, local_world_size=2, local_rank=1))
    with pytest.raises(RuntimeError, match="already exists"):
        init_process_group(make_env(rank=1, world_size=4, local_world_size=4, local_rank=1))


def test_destroy_process_group() -> None:
    destroy_process_group()  # nothing to destroy: must not raise
    assert not dist.is_initialized()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    assert dist.is_initialized()
    destroy_process_group()
    assert not dist.is_initialized()
