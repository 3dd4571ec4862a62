"""config.rules.check is one function per section of the schema: each names only its own section's keys, and
together they find every problem (a config broken in every section at once)."""

from __future__ import annotations

import dataclasses
import inspect

from hpcdist.config import layout, loader, rules
from hpcdist.config.schema import JobConfig

# one or more bad values in every section (each alone is a test elsewhere in tests/unit/config/test_config.py)
BROKEN = [
    "run.log_level=LOUD",
    "run.seed=-1",
    "model.dim=7",
    "model.n_heads=3",
    "data.source=files",
    "data.val_fraction=0",
    "data.prefetch=-1",
    "data.seq_len=100000",
    "data.dtype=int8",
    "optim.lr=-1",
    "optim.beta1=1",
    "optim.min_lr_ratio=2",
    "optim.schedule=step",
    "train.steps=0",
    "train.global_batch_size=7",
    "train.micro_batch_size=2",
    "train.eval_every_steps=5",
    "train.nonfinite=skip",
    "train.max_nonfinite_skips=0",
    "parallel.strategy=zero",
    "parallel.tp=2",
    "parallel.fsdp.replicate=0",
    "parallel.ddp.bucket_cap_mb=0",
    "parallel.ddp.comm_hook=powersgd",
    "checkpoint.keep_last=0",
    "checkpoint.verify=sha1",
    "checkpoint.every_minutes=-1",
    "fault.max_restarts=-1",
    "fault.max_same_failure=0",
    "fault.max_preemptions=-5",
    "fault.requeue_signal=KILL",
    "logging.every_steps=0",
    "logging.straggler_factor=0.5",
    "logging.profile.start_step=0",
]


def _broken() -> JobConfig:
    data, problems = loader.load_tree(None, BROKEN)
    cfg = loader.build(JobConfig, data, "", problems)  # types only: the rules are what is tested
    assert not problems, problems
    return cfg


def _section_problems(cfg: JobConfig, section: str) -> list[str]:
    check = getattr(rules, f"_check_{section}")
    args = {"cfg": cfg, "kind": layout.requested_kind(cfg.parallel), "bad_paths": set()}
    return check(**{name: args[name] for name in inspect.signature(check).parameters})


def test_each_section_has_its_check_and_it_names_only_that_section() -> None:
    cfg = _broken()
    for field in dataclasses.fields(JobConfig):
        found = _section_problems(cfg, field.name)
        assert found, f"{field.name}: none of its broken values was found"
        # a problem opens with the key it is about (several keys: the first), in this section
        assert all(line.startswith(f"{field.name}.") for line in found), (field.name, found)


def test_check_is_the_sections_together() -> None:
    cfg = _broken()
    sections = [line for f in dataclasses.fields(JobConfig) for line in _section_problems(cfg, f.name)]
    assert sorted(rules.check(cfg)) == sorted(rules._maxima(cfg) + rules._paths(cfg)[0] + sections)
