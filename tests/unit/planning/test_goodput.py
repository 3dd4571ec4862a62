"""The goodput model (hpcdist.checkpoint.cadence) against a brute-force scan of its own goodput function, and the
goodput section `hpcdist plan` prints from the planner's predictions (hpcdist.planning.goodput)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from hpcdist.checkpoint import cadence
from hpcdist.checkpoint.cadence import Recovery, Tier
from hpcdist.cli import main
from hpcdist.config.cluster import load_cluster

RECOVERY = Recovery(detect_s=90, restart_s=120, init_s=60, load_s=25, first_step_s=30)


def _scan(tier: Tier, mtbf_s: float) -> tuple[float, float]:
    """(interval, goodput) of the best of a fine geometric grid of intervals: the model's own optimum."""
    best = (0.0, -1.0)
    for i in range(20_000):
        tau = 1e-2 * mtbf_s * 1.0006**i / 1e3  # 1e-5 M .. ~1.6e0 M
        g = cadence.segment_split(tau, tier, mtbf_s).useful
        best = max(best, (tau, g), key=lambda x: x[1])
    return best


@pytest.mark.parametrize("ratio", [1e-6, 1e-4, 1e-2, 0.1, 0.5])  # C / M: from C << M to C not small against M
def test_dalys_interval_is_the_optimum_of_the_models_own_goodput(ratio: float) -> None:
    mtbf = 10_000.0
    tier = Tier(cost_s=ratio * mtbf, recovery=RECOVERY)
    tau, best = _scan(tier, mtbf)
    daly = cadence.optimal_interval(tier.cost_s, mtbf)
    at_daly = cadence.segment_split(daly, tier, mtbf).useful
    assert at_daly == pytest.approx(best, rel=2e-4)  # the goodput Daly's interval reaches: the scan's best
    assert daly == pytest.approx(tau, rel=0.06 if ratio >= 0.1 else 0.01)
    young = cadence.young_interval(tier.cost_s, mtbf)
    if ratio <= 1e-4:  # Young's first-order interval agrees only while C << M
        assert young == pytest.approx(tau, rel=0.01)
    else:
        assert abs(daly - tau) < abs(young - tau)


def test_recovery_and_background_write_do_not_move_the_optimum_but_cost_goodput() -> None:
    mtbf = 50_000.0
    quick = Tier(cost_s=20, recovery=Recovery(0, 0, 0, 0, 0))
    slow = Tier(cost_s=20, recovery=RECOVERY)
    assert _scan(quick, mtbf)[0] == pytest.approx(_scan(slow, mtbf)[0], rel=1e-3)
    tau = cadence.optimal_interval(20, mtbf)
    assert cadence.segment_split(tau, slow, mtbf).useful < cadence.segment_split(tau, quick, mtbf).useful


def test_the_split_adds_up_and_recomputed_work_is_half_the_interval_per_failure() -> None:
    mtbf, tier = 1e7, Tier(cost_s=10, recovery=RECOVERY)
    split = cadence.segment_split(3600, tier, mtbf)
    assert split.useful + split.checkpoint + split.recompute + split.recovery == pytest.approx(1.0)
    failures_per_s = 1 / mtbf  # first order: each failure costs half a segment of work and one recovery
    assert split.recompute == pytest.approx(failures_per_s * 3610 / 2, rel=0.01)
    assert split.recovery == pytest.approx(failures_per_s * RECOVERY.total_s, rel=0.01)
    assert split.checkpoint == pytest.approx(10 / 3610, rel=0.01)
    assert cadence.segment_split(3600, tier, math.inf).recompute == 0.0


def test_goodput_rises_with_the_mtbf_and_falls_with_the_nodes() -> None:
    shared = Tier(cost_s=25, recovery=RECOVERY, write_s=25)
    local = Tier(cost_s=4, recovery=RECOVERY)
    for kw in ({}, {"local": local, "local_coverage": 0.9}):
        by_mtbf = [cadence.predict(node_mtbf_hours=h, nodes=512, shared=shared, **kw).goodput for h in (10, 100, 1e3)]
        assert by_mtbf == sorted(by_mtbf) and by_mtbf[0] < by_mtbf[-1] < 1.0
        by_nodes = [cadence.predict(node_mtbf_hours=5696, nodes=n, shared=shared, **kw).goodput for n in (4, 128, 2048)]
        assert by_nodes == sorted(by_nodes, reverse=True)
    p = cadence.predict(node_mtbf_hours=5696, nodes=4, shared=shared)
    assert p.system_mtbf_s == pytest.approx(5696 * 3600 / 4)
    assert p.goodput == pytest.approx(1 - p.checkpoint - p.recompute - p.recovery)
    assert p.shared_interval_s >= shared.write_s  # never more often than one background write takes


def test_a100_ib_node_mtbf_is_llama_3s_interruption_rate() -> None:
    hw = load_cluster("a100_ib").hardware
    assert hw is not None and hw.node_mtbf_hours == pytest.approx(54 * 24 * 2048 / 466, abs=1)
    for bad in (0, -5, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="node_mtbf_hours: must be a positive finite number"):
            load_cluster("a100_ib", hardware={"node_mtbf_hours": bad})
    assert load_cluster("a100_ib", hardware={"node_mtbf_hours": 100}).hardware.node_mtbf_hours == 100


def test_plan_prints_the_predicted_goodput_its_split_and_the_cadence(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "configs/train_13b.yaml", "--nodes", "4"]) == 0
    out = capsys.readouterr().out
    section = out[out.index("Goodput") :].splitlines()
    assert "node MTBF 5,696 h from cluster a100_ib" in section[0]
    assert "step 15.30 s (the layout's prediction)" in section[1] and "recovery" in section[1]
    header = section[2].split()
    assert header[:5] == ["GPUs", "nodes", "MTBF", "h", "cadence"]
    assert {"goodput", "ckpt", "recomp", "recov"} <= set(header)
    rows = [line.split() for line in section[3:9]]
    assert [(r[0], r[3]) for r in rows] == [
        ("32", "configured"),
        ("32", "recommended"),
        ("1,024", "configured"),
        ("1,024", "recommended"),
        ("16,384", "configured"),
        ("16,384", "recommended"),
    ]
    assert rows[0][2] == f"{5696 / 4:,.2f}" and rows[4][2] == f"{5696 / 2048:,.2f}"  # system MTBF = node / nodes
    goodput = [float(r[4].rstrip("%")) for r in rows]
    assert goodput[1] >= goodput[0] and goodput[5] > goodput[4]  # the recommended cadence is never worse
    assert "every 127.5 min (~500 steps)" in section[3]  # checkpoint.every_steps=500 at 15.3 s per step
    assert "recommended for this job: checkpoint.every_minutes=" in section[9]


def test_plan_without_a_node_mtbf_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = Path("hpcdist/resources/cluster/a100_ib.yaml").read_text()
    profile = tmp_path / "site.yaml"
    profile.write_text("\n".join(line for line in text.splitlines() if "node_mtbf_hours" not in line) + "\n")
    assert main(["plan", "configs/train_13b.yaml", "--nodes", "4", "--cluster", str(profile)]) == 0
    assert "goodput: cluster 'site' gives no hardware.node_mtbf_hours: no prediction" in capsys.readouterr().out
