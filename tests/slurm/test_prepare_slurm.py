"""On the sandbox: ``hpcdist prepare --cluster sandbox --tasks 4`` as one job array and a merge job; one
task's tokenizing process SIGKILLed after its first shard requeues that task alone, which keeps the shard; the
merged dataset equals the one-machine prepare byte for byte; a training job submitted ``--after`` the merge (before
the data exists) trains on it."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

import hpcdist
from hpcdist.data.array import KILL_ENV, prepare_status
from hpcdist.data.prepare import prepare_corpus
from hpcdist.launch.prepare_array import submit_prepare
from tests.slurm.conftest import Cluster, job_info, release_requeue_hold
from tests.slurm.harness import step_losses, tiny_overrides

SHARD = 2**15


def _jsonl(name: str, n: int, noise: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)  # hex noise: gzip cannot shrink it much, so the big file stays big
    return b"".join(json.dumps({"text": f"{name} {i} " + rng.bytes(noise).hex()}).encode() + b"\n" for i in range(n))


@pytest.fixture
def login_env(slurm_cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> Cluster:
    for key, value in slurm_cluster.env.items():
        monkeypatch.setenv(key, value)
    return slurm_cluster


def test_prepare_array_killed_task_requeued_equals_one_machine_and_trains(
    login_env: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "corpus"
    src.mkdir()
    for k in range(3):
        (src / f"small{k}.jsonl").write_bytes(_jsonl(f"small{k}", 40, 100, k))
    (src / "small.jsonl.gz").write_bytes(gzip.compress(_jsonl("smallgz", 40, 100, 7)))
    # the large one: 8 gzip members (pigz --independent / cat a.gz b.gz style), ~0.9 MB
    (src / "large.jsonl.gz").write_bytes(b"".join(gzip.compress(_jsonl(f"m{m}", 120, 450, 10 + m)) for m in range(8)))
    files = sorted(src.iterdir())
    one = prepare_corpus(files, tmp_path / "one", shard_tokens=SHARD).path

    out = tmp_path / "ds"
    monkeypatch.setenv(KILL_ENV, "1")  # task 1's process dies right after its first shard, on its first run
    res = submit_prepare(files, out, tasks=4, cluster="sandbox", shard_tokens=SHARD, cpus_per_task=1)
    array = res["array"][0].job_id.split("_")[0]
    merge = res["merge"]
    # training waits on the merge: submitted now, while the data does not exist yet
    run = tmp_path / "run"
    train = hpcdist.submit(
        "configs/demo.yaml",
        tiny_overrides(run, out, 2, "model.vocab_size=320", "data.seq_len=64"),
        cluster="sandbox",
        nodes=1,
        gpus_per_node=1,
        after=f"{merge.job_id}:afterok",
    )
    assert release_requeue_hold(login_env, f"{array}_1", timeout=120)["Restarts"] == "1"
    logs = out / "parts" / "slurm"
    state = merge.wait(timeout=180)
    assert state == "COMPLETED", "\n".join(f"{f.name}: {f.read_text()[-800:]}" for f in sorted(logs.glob("*.out")))
    for i in range(4):  # the killed task alone ran again
        assert job_info(login_env, f"{array}_{i}")["Restarts"] == ("1" if i == 1 else "0"), i
    log1 = (logs / f"{array}_1_0_log.out").read_text()
    assert "was killed (SIGKILL); requeueing" in log1 and "1 shards kept from an earlier run" in log1, log1

    def stream(d: Path) -> bytes:
        meta = json.loads((d / "meta.json").read_text())
        return b"".join((d / s["name"]).read_bytes() for s in meta["shards"])

    def meta_but_shards(d: Path) -> dict:
        return {k: v for k, v in json.loads((d / "meta.json").read_text()).items() if k != "shards"}

    assert stream(out) == stream(one) and meta_but_shards(out) == meta_but_shards(one)
    shards = json.loads((out / "meta.json").read_text())["shards"]
    assert {s["name"].split("/")[1] for s in shards} == {"0", "1", "2", "3"}  # every task made a part
    status = prepare_status(out)
    assert status.count(" done ") == 4 and "merged:" in status, status
    assert train.wait(timeout=240) == "COMPLETED", train.paths[0].stdout.read_text()[-3000:]
    assert sorted(step_losses(run)) == [1, 2]
