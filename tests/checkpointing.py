"""A tiny model's state through the trainer's Checkpointable interface: what the checkpoint tests of every tier
save, damage and restore without building a Trainer."""

from __future__ import annotations

import torch

from hpcdist.checkpoint.state import Checkpointable


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
