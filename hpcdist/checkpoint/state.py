"""What a checkpoint holds (:class:`Checkpointable`: callables, so the manager never knows a strategy's types) and
the per-rank RNG state saved beside it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

STATE_FILE = "trainer_state.json"


RANK_DIR = "rank"  # rank/rank-<r>.pt: each rank's own state (Checkpointable.rank_state)


@dataclass
class Checkpointable:
    """What a checkpoint holds, as callables so the manager never knows the strategy's types. (Not torch's
    ``Stateful`` protocol: DCP's state_dict/load_state_dict pair covers only the first two of these.)"""

    dcp_state: Callable[[], dict[str, Any]]
    """Sharded state (model + optimizer) for DCP; also the destination tensors on load."""
    load_dcp_state: Callable[[dict[str, Any]], None]
    trainer_state: Callable[[], dict[str, Any]]
    load_trainer_state: Callable[[dict[str, Any]], None]
    save_planner: Any = None
    """A DCP SavePlanner for ``dcp_state`` (None: DCP's default). ``hpcdist import`` passes one that reads each
    tensor from the Hugging Face files only when it is written (hpcdist.hf.import_.HFSavePlanner)."""
    rank_state: Callable[[], dict[str, Any]] = dict
    """This rank's own state (differs per rank, e.g. PowerSGD error feedback): rank/rank-<r>.pt when not empty."""
    load_rank_state: Callable[[dict[str, Any]], None] = lambda _: None
    """Called with the saved dict, or an empty one when this rank has none (more ranks than saved)."""


def rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
