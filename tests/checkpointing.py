"""What the checkpoint tests of every tier share: a tiny model's state through the trainer's Checkpointable
interface (saved, damaged and restored without building a Trainer), and the shared tier's storages, each test of
the manager's decisions run against every one of them."""

from __future__ import annotations

from pathlib import Path

import torch

from hpcdist.checkpoint.state import Checkpointable
from hpcdist.checkpoint.storage import MemoryStorage, PosixStorage, Storage

STORAGES = ("posix", "memory")


def make_storage(kind: str, root: Path) -> Storage:
    """An empty storage of ``kind`` (one of STORAGES) for step directories under ``root``."""
    if kind == "posix":
        root.mkdir(parents=True)
        return PosixStorage(root)
    return MemoryStorage(root)


class TinyState:
    """A tiny model's state through the trainer's Checkpointable interface."""

    def __init__(self, run_dir: str = "r") -> None:
        self.w = torch.nn.Linear(4, 4)
        self.step, self.run_dir = 0, run_dir

    def checkpointable(self) -> Checkpointable:
        cfg = {"run": {"dir": self.run_dir, "seed": 0}, "model": {"dim": 4}, "data": {}, "parallel": {}}
        return Checkpointable(
            dcp_state=lambda: {"model": self.w.state_dict()},
            load_dcp_state=lambda d: self.w.load_state_dict(d["model"]),
            trainer_state=lambda: {"step": self.step, "config": cfg},
            load_trainer_state=lambda s: setattr(self, "step", s["step"]),
        )
