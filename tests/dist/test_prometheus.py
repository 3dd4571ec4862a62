"""logging.prometheus.port: scraped over HTTP while a 2-rank run trains, the counters increase."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist.harness import free_port, run_ranks
from tests.training import train

pytestmark = pytest.mark.dist
prometheus_client = pytest.importorskip("prometheus_client", reason="pip install 'hpcdist[prometheus]'")


_SCRAPER = """
import json, os, sys, time, urllib.request
port, out, stop = sys.argv[1:]
scrapes = []
while not os.path.exists(stop):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            scrapes.append(r.read().decode())
    except OSError:
        pass  # not started yet, or already gone
    time.sleep(0.05)
open(out, "w").write(json.dumps(scrapes))
"""


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_scraped_during_a_2_rank_run_counters_increase(small_cfg, tmp_path: Path) -> None:
    port = free_port()
    cfg = small_cfg(
        "train.steps=40", "logging.straggler_every_steps=5", f"logging.prometheus.port={port}", run_dir=tmp_path / "run"
    )
    # the scraper is a process of its own: a thread in this process would be forked into the ranks in the middle of
    # whatever it holds (the import lock of its first urlopen), and a rank would wait on it forever
    out, stop = tmp_path / "scrapes.json", tmp_path / "stop"
    scraper = subprocess.Popen([sys.executable, "-c", _SCRAPER, str(port), str(out), str(stop)])
    try:
        assert [out["step"] for out in run_ranks(2, train, cfg)] == [40, 40]
    finally:
        stop.touch()
        scraper.wait(timeout=60)
    scrapes = json.loads(out.read_text())

    with_steps = [_samples(s) for s in scrapes if "hpcdist_steps_total{" in s]
    assert len(with_steps) >= 2, f"{len(scrapes)} scrapes"
    node = (("job", cfg.run.name), ("node", "0"))
    steps = [s[("hpcdist_steps_total", node)] for s in with_steps]
    tokens = [s[("hpcdist_tokens_total", node)] for s in with_steps]
    assert steps == sorted(steps) and steps[-1] > steps[0]  # a counter never goes back, and it moved
    assert tokens == sorted(tokens) and tokens[-1] > tokens[0]
    last = with_steps[-1]
    per_step = cfg.train.global_batch_size * cfg.data.seq_len
    assert last[("hpcdist_tokens_total", node)] == per_step * last[("hpcdist_steps_total", node)]
    assert last[("hpcdist_step_duration_seconds_count", node)] == last[("hpcdist_steps_total", node)]
    assert last[("hpcdist_loss", node)] > 0 and last[("hpcdist_tokens_per_second", node)] > 0
    assert last[("hpcdist_restarts_total", node)] == 0
    # only rank 0 (local rank 0 of the one node) serves; both local ranks' memory is there after a straggler check
    mem = {dict(k[1])["local_rank"]: v for k, v in last.items() if k[0] == "hpcdist_memory_bytes"}
    assert sorted(mem) == ["0", "1"] and all(v > 2**20 for v in mem.values())
