"""The flagship path, scaled down: ``sbatch sbatch/train_13b.sh`` as shipped (ZeRO-3, async checkpoint, USR2
requeue) with a tiny model, preempted mid-run, requeued by itself and resumed exactly from its stop checkpoint.

Only the size changes (model, data, steps, batch, checkpoint cadence); the strategy, the ZeRO stage and the async
save come from configs/train_13b.yaml itself, and the test checks they did.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from hpcdist import config as config_mod
from hpcdist.checkpoint.manifest import MANIFEST
from hpcdist.checkpoint.names import MARKER
from tests.conftest import SMALL
from tests.slurm.conftest import REPO, Cluster, job_info, release_requeue_hold, run_cmd, wait_job
from tests.slurm.harness import step_losses, submit, wait_for_step

# --exclusive=user: the script's `#SBATCH --exclusive` (a whole node per job, right for 13B) kept the uninterrupted
# reference job and the preempted one from sharing the sandbox's one node, so they ran one after the other; =user
# still keeps other users' jobs off the node
TWO_RANKS = ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=2", "--cpus-per-task=1", "--exclusive=user"]


def _flagship_overrides(run: Path, corpus: Path, steps: int) -> list[str]:
    """Size only: the only periodic checkpoint comes after the end, so a resume can only use the stop checkpoint."""
    return [
        *SMALL,
        f"run.dir={run}",
        "data.source=files",
        f"data.path={corpus}",
        "data.seq_len=32",
        f"train.steps={steps}",
        "train.global_batch_size=4",
        "train.micro_batch_size=1",
        "train.eval_every_steps=0",
        "logging.every_steps=1",
        "logging.tensorboard=false",
        f"checkpoint.every_steps={steps}",
    ]


def test_flagship_zero3_async_checkpoint_requeues_and_resumes_exactly(
    slurm_cluster: Cluster, corpus_dir: Path, tmp_path: Path
) -> None:
    steps = 24
    straight_run, pre_run = tmp_path / "straight", tmp_path / "pre"
    over = _flagship_overrides(pre_run, corpus_dir, steps)
    cfg = config_mod.load(REPO / "configs" / "train_13b.yaml", over)
    # what makes this the flagship path, from the shipped config, not from the overrides
    assert (cfg.parallel.strategy, cfg.parallel.zero.stage, cfg.checkpoint.async_save) == ("zero", 3, True)
    assert cfg.fault.requeue_signal == "USR2"

    straight = submit(
        slurm_cluster,
        "train_13b.sh",
        TWO_RANKS,
        _flagship_overrides(straight_run, corpus_dir, steps),
        tmp_path / "straight.txt",
    )
    job = submit(slurm_cluster, "train_13b.sh", TWO_RANKS, over, tmp_path / "pre.txt")
    wait_for_step(pre_run, 6, timeout=240)
    run_cmd(slurm_cluster, "scancel", "--signal=USR2", "--batch", job)  # what --signal=B:USR2@300 delivers
    info = release_requeue_hold(slurm_cluster, job, timeout=180)
    assert info["Restarts"] == "1"
    out_file = tmp_path / "pre.txt"
    assert wait_job(slurm_cluster, job, timeout=420) == "COMPLETED", out_file.read_text()[-5000:]
    assert wait_job(slurm_cluster, straight, timeout=420) == "COMPLETED", (tmp_path / "straight.txt").read_text()[
        -5000:
    ]

    out = out_file.read_text()
    assert "zero on 2 rank(s)" in out and "layout: zero3 x 2 ranks" in out
    assert "stop requested (TIME_LIMIT)" in out
    # the stop checkpoint (async) was complete before the requeue, and the second run resumed from it
    (stop_step,) = {int(s) for s in re.findall(r"resumed from \S+step-(\d+) at step \d+", out)}
    assert 6 <= stop_step < steps
    stop_dir = pre_run / "checkpoints" / f"step-{stop_step:08d}"
    assert (stop_dir / MARKER).is_file() and (stop_dir / MANIFEST).is_file()
    assert json.loads((stop_dir / MARKER).read_text())["step"] == stop_step
    assert not (stop_dir / "native").exists()  # ZeRO-3's partitions (fp32 master, moments) are in the DCP shards
    assert out.count("starting fresh") == 1  # the first run only
    assert job_info(slurm_cluster, job)["Restarts"] == "1"

    # exact: every step's loss equals the uninterrupted job's (same 2 ranks, same ZeRO-3 partitioning)
    ref, got = step_losses(straight_run), step_losses(pre_run)
    assert sorted(got) == sorted(ref) == list(range(1, steps + 1))
    assert [got[s] for s in range(1, steps + 1)] == [ref[s] for s in range(1, steps + 1)]
    print(
        f"\nflagship (zero3, async save, USR2): stopped at step {stop_step}, checkpoint complete, requeued, resumed; "
        f"{steps} losses equal to the uninterrupted job's"
    )
