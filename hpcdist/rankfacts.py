"""One rank's facts, built once and handed down: the config with its layout resolved, the DistEnv, the ParallelDims.

:func:`rank_facts` is the one place that turns a loaded config and a DistEnv into what the rank trains: it checks the
job's size against the config (:func:`hpcdist.config.check_world`) and the prepared data against the model
(:func:`hpcdist.config.check_data`), resolves ``parallel.strategy=auto`` through the planner it is given, and builds
the layout's :class:`ParallelDims`. ``hpcdist.run`` calls it before the process group (with the planner) and hands the
result to the Trainer, which hands ``dims`` to the strategy builder; a Trainer built directly (the Python API,
``Trainer(cfg, env)``) calls the same function, without a planner. The way torchtitan's ``Trainer.__init__`` builds
``ParallelDims`` once and passes it to every builder.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hpcdist import config as config_mod
from hpcdist.config import JobConfig
from hpcdist.env import DistEnv
from hpcdist.parallel.dims import ParallelDims, parallel_dims

__all__ = ["LayoutPlanner", "RankFacts", "rank_facts"]

LayoutPlanner = Callable[[JobConfig, DistEnv], JobConfig]
"""``parallel.strategy=auto`` -> a config with the planner's layout for this rank's world (hpcdist.run's)."""


@dataclass(frozen=True)
class RankFacts:
    """What every builder of one rank reads, checked: ``cfg`` names a layout (never auto), ``cfg`` fits
    ``env.world_size`` ranks (batch split, layout rules, tensor parallel inside a node) and its prepared data fits the
    model; ``dims`` is the layout, the one ParallelDims of the rank (data loader, strategy, meshes, log line)."""

    cfg: JobConfig
    env: DistEnv
    dims: ParallelDims


def rank_facts(cfg: JobConfig, env: DistEnv, *, plan_layout: LayoutPlanner | None = None) -> RankFacts:
    """Check, resolve and build once (raises ConfigError / DataError, one line per problem, before any process group
    when hpcdist.run calls it). Without ``plan_layout`` an ``auto`` config is refused: a Trainer builds exactly the
    layout it is given and imports no planner."""
    auto = config_mod.needs_planner(cfg.parallel.strategy)
    if not auto:
        # the batch split as configured first: its message names the user's own values, and a bad one fails fast
        config_mod.check_world(cfg, env.world_size, ranks_per_node=env.local_world_size)
    # the prepared data exists and its ids fit the embedding table: one line now, not an IndexError mid-run
    config_mod.check_data(cfg)
    if auto:
        if plan_layout is None:
            raise ValueError("parallel.strategy=auto must be resolved before building a Trainer (hpcdist.run)")
        cfg = plan_layout(cfg, env)
        # the planner keeps to these rules already; checked like any config all the same (auto skipped them above)
        config_mod.check_world(cfg, env.world_size, ranks_per_node=env.local_world_size)
    return RankFacts(cfg=cfg, env=env, dims=parallel_dims(cfg, env.world_size))
