"""The planner's words are true: a layout within 5% of usable GPU memory is marked tight and `auto` takes a roomier
one when there is one; when only CPU-offload rows fit, the plan names the keys that turn offload on; and the
README's sentence about configs/train_13b.yaml on one node is what `hpcdist plan` prints."""

from __future__ import annotations

import re

import pytest

from hpcdist import config as config_mod
from hpcdist.cli import main
from hpcdist.config.cluster import load_cluster
from hpcdist.planning import layouts as planner
from hpcdist.planning.memory import GIB
from tests.unit.harness import README, REPO

CONFIG = str(REPO / "configs" / "train_13b.yaml")


def _estimates(nodes: int, gpus: int = 8) -> tuple[config_mod.JobConfig, list[planner.StepEstimate], float]:
    cfg = config_mod.load(CONFIG)
    cluster = load_cluster("a100_ib", nodes=nodes, gpus_per_node=gpus)
    hw = planner.cluster_hardware(cluster)
    estimates = planner.rank_layouts(
        cfg.model_args(),
        world_size=nodes * gpus,
        gpus_per_node=gpus,
        global_batch_size=cfg.train.global_batch_size,
        seq_len=cfg.data.seq_len,
        hw=hw,
        reduce_bytes=planner.grad_reduce_bytes(cfg),
        element_bytes=planner.activation_element_bytes(cfg),
    )
    return cfg, estimates, hw.usable_bytes


def test_a_layout_within_5_percent_of_usable_memory_is_tight() -> None:
    _, estimates, usable = _estimates(nodes=1)
    fitting = [e for e in estimates if e.fits]
    tight = [e for e in fitting if e.memory.total > 0.95 * usable]
    assert tight, "the 13B config on one node has layouts within 5% of usable memory"
    assert all(e.tight for e in tight)
    assert not any(e.tight for e in fitting if e.memory.total <= 0.95 * usable)
    assert not any(e.tight for e in estimates if not e.fits)


def test_auto_takes_a_roomier_layout_than_a_tight_one() -> None:
    cfg, estimates, usable = _estimates(nodes=1)
    assert any(e.fits and e.memory.total <= 0.95 * usable for e in estimates)
    _, chosen, reason = planner.pick(cfg, estimates, 8, 8)
    assert chosen.memory.total <= 0.95 * usable, f"auto took {chosen.memory.total / GIB:.1f} GiB: {reason}"
    assert not chosen.tight


def test_plan_marks_tight_rows_in_its_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", CONFIG, "--nodes", "1", "--all", "--top", "200"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+(\d+|-)\s+(ddp|zero\d|fsdp|hsdp|3d)\s", line)]
    _, estimates, _ = _estimates(nodes=1)
    marked = {float(r[7]) for r in rows if r[8] == "tight"}
    expected = {round(e.memory.total / GIB, 1) for e in estimates if e.tight}
    assert marked == expected and marked
    assert "tight = within 5% of the usable memory" in out


def test_when_only_offload_fits_the_plan_names_the_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", CONFIG, "--nodes", "1", "--gpus-per-node", "1"]) == 1
    captured = capsys.readouterr()
    assert "zero3+offload" in captured.out and "none of" in captured.err
    assert "parallel.strategy=zero parallel.zero.stage=3 parallel.zero.offload_optimizer=true" in captured.err
    assert "parallel.zero.offload_params=true" in captured.err


def test_the_readme_sentence_on_13b_on_one_node_is_what_plan_prints(capsys: pytest.CaptureFixture[str]) -> None:
    text = " ".join(README.read_text(encoding="utf-8").split())
    m = re.search(r"`(hpcdist plan configs/train_13b\.yaml --nodes 1)` marks it tight \(([\d.]+) of ([\d.]+) GiB", text)
    assert m, "README.md: the sentence on configs/train_13b.yaml on one node"
    command, need, usable = m.group(1), float(m.group(2)), float(m.group(3))
    args = command.split()[1:]  # after `hpcdist`: plan, the config (the checkout's), its options
    args[1] = CONFIG
    assert main(args) == 0
    out = capsys.readouterr().out
    flat = " ".join(out.split())  # the plan wraps its lines
    mine = re.search(r"the config's layout: (.*?)\)", flat)
    assert mine and "tight" in mine.group(1) and f"({need} GiB/GPU of {usable:g} usable" in mine.group(1), flat
    auto = re.search(r"auto would take row (.*?) as overrides", flat)
    assert auto and f"{need} GiB/GPU" not in auto.group(1), auto
