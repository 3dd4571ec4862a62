"""``hpcdist config``: print the resolved, validated config, the key reference (``--reference``) or a commented
starter config (``--commented``); and ``warn_data``, which a dry run and the planner share: a plan made without the
job's data warns about it rather than refusing, and a preset hidden by the file's own model keys is named."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from hpcdist import config as config_mod
from hpcdist.base.errors import CommandError
from hpcdist.config import loader, reference
from hpcdist.config.schema import JobConfig, ModelConfig
from hpcdist.models.args import load_preset


def warn_data(cfg: JobConfig, path: str | None = None) -> None:
    """A dry run plans a job without its data: a missing dataset or a vocabulary mismatch is a warning there. With
    the config's ``path``: also the line naming model keys that hide the file's preset."""
    problems = config_mod.check_data(cfg, strict=False)
    shadows = loader.preset_shadows(path) if path is not None else None
    for problem in [*([shadows] if shadows else []), *problems]:
        print(f"hpcdist: warning: {problem}", file=sys.stderr, flush=True)


def starter_tree(cfg: JobConfig) -> dict[str, Any]:
    """``cfg`` as a tree whose model section holds the preset and only the keys that differ from it (a key the
    preset does not set: only where it differs from the default)."""
    tree = cfg.to_dict()
    model = tree["model"]
    if cfg.model.preset:
        values = load_preset(cfg.model.preset)
        defaults = dataclasses.asdict(ModelConfig())
        kept = {
            k: v for k, v in model.items() if k != "preset" and (v != values[k] if k in values else v != defaults[k])
        }
        tree["model"] = {"preset": cfg.model.preset, **kept}
    return tree


def cmd_config(args: argparse.Namespace) -> int:
    if args.reference is not None:
        section = args.reference or None
        if section is not None and section not in reference.SECTIONS:
            raise CommandError(f"config --reference: no section {section!r}; one of {', '.join(reference.SECTIONS)}")
        print(reference.text(section), end="")
        return 0
    if args.config is None:
        raise CommandError("config: give a CONFIG (a YAML file, or demo / train_13b), or --reference [SECTION]")
    cfg = config_mod.load(args.config, args.overrides)
    warn_data(cfg, args.config)
    config_mod.check_world(cfg, args.world_size)
    print(reference.commented(starter_tree(cfg)) if args.commented else config_mod.dump(cfg), end="")
    return 0
