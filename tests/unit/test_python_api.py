"""The Python API without hpcdist.run: ``Trainer(cfg, from_environ()).train()`` in a plain ``python`` process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, SMALL

CODE = """
import sys
from hpcdist import config as config_mod
from hpcdist.env import from_environ
from hpcdist.trainer import Trainer
cfg = config_mod.load(None, sys.argv[1:])
print("trained to step", Trainer(cfg, from_environ(cuda_available=False)).train().step)
"""


def test_a_trainer_built_directly_trains_with_zero_in_one_process(tmp_path: Path) -> None:
    """DeepSpeed asserts LOCAL_RANK even for one process; only hpcdist.run exported it (with the process group), so
    the documented Python API failed with strategy zero in a plain python process."""
    launcher = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher and not k.startswith("SLURM_")}
    over = [
        *SMALL,
        "data.source=synthetic",
        "train.steps=2",
        "train.global_batch_size=2",
        "train.micro_batch_size=1",
        "parallel.strategy=zero",
        "parallel.zero.stage=2",
        f"run.dir={tmp_path / 'run'}",
    ]
    p = subprocess.run(
        [sys.executable, "-c", CODE, *over], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "trained to step 2" in p.stdout
