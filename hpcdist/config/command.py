"""``hpcdist config``: print the resolved, validated config (and ``warn_data``, which a dry run shares: a plan made
without the job's data warns about it rather than refusing)."""

from __future__ import annotations

import argparse
import sys

from hpcdist import config as config_mod
from hpcdist.config.schema import JobConfig


def warn_data(cfg: JobConfig) -> None:
    """A dry run plans a job without its data: a missing dataset or a vocabulary mismatch is a warning there."""
    for problem in config_mod.check_data(cfg, strict=False):
        print(f"hpcdist: warning: {problem}", file=sys.stderr, flush=True)


def cmd_config(args: argparse.Namespace) -> int:
    cfg = config_mod.load(args.config, args.overrides)
    warn_data(cfg)
    config_mod.check_world(cfg, args.world_size)
    print(config_mod.dump(cfg), end="")
    return 0
