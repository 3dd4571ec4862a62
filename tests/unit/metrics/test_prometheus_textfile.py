"""logging.prometheus.textfile: the node_exporter textfile collector's file, rewritten at every log step."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcdist import config as config_mod
from hpcdist.metrics.prometheus import PrometheusExporter

pytest.importorskip("prometheus_client", reason="pip install 'hpcdist[prometheus]'")


def test_textfile_holds_the_conventional_names_and_counts(tmp_path: Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    cfg = config_mod.load(None, [f"logging.prometheus.textfile={tmp_path}/prom/hpcdist-{{node}}.prom"])
    exp = PrometheusExporter(cfg, enabled=True, node=3, job="77", restarts=2)
    for _ in range(4):
        exp.step(0.2, samples=8, tokens=256)
    exp.log(
        {"loss": 2.5, "grad_norm": 0.7, "tokens_per_s": 1280.0, "mfu": 0.4, "comm_share": 0.25},
        samples_per_token=1 / 32,
        local_memory=[1.0, 2.0],
    )
    text = (tmp_path / "prom" / "hpcdist-3.prom").read_text()
    got = {
        (s.name, s.labels.get("local_rank")): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.labels.get("node") == "3" and s.labels.get("job") == "77"
    }
    assert got[("hpcdist_steps_total", None)] == 4 and got[("hpcdist_tokens_total", None)] == 1024
    assert got[("hpcdist_samples_total", None)] == 32 and got[("hpcdist_restarts_total", None)] == 2
    assert got[("hpcdist_step_duration_seconds_count", None)] == 4
    assert got[("hpcdist_step_duration_seconds_sum", None)] == pytest.approx(0.8)
    assert got[("hpcdist_samples_per_second", None)] == 40 and got[("hpcdist_comm_share_ratio", None)] == 0.25
    assert got[("hpcdist_memory_bytes", "1")] == 2 * 2**30


def test_off_by_default_and_port_or_textfile_not_both(tmp_path: Path) -> None:
    assert not PrometheusExporter(config_mod.load(None, []), enabled=True, node=0, job="j", restarts=0).active
    with pytest.raises(config_mod.ConfigError) as e:
        config_mod.load(None, ["logging.prometheus.port=9400", f"logging.prometheus.textfile={tmp_path}/x.prom"])
    assert "logging.prometheus: set port or textfile, not both" in str(e.value)
