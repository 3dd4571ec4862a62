"""W&B (offline) and MLflow (file store) get what metrics.jsonl gets, and a resumed run continues the same tracker run.

One real single-rank training run, interrupted at step 3 (a checkpoint) and resumed to step 6 by a second Trainer,
with both trackers on. No network: W&B offline writes its transaction log under <run.dir>/wandb, MLflow a file
store under tmp_path.
"""

from __future__ import annotations

import json
import re
import struct
import threading
import zlib
from pathlib import Path

import pytest

from hpcdist import config as config_mod
from hpcdist.base.rundir import RunDir
from hpcdist.config import ConfigError
from tests.conftest import SMALL
from tests.dist.harness import single
from tests.training import train

wandb = pytest.importorskip("wandb", reason="wandb not installed (pip install 'hpcdist[wandb]'): W&B test skipped")
mlflow = pytest.importorskip("mlflow", reason="mlflow not installed (pip install 'hpcdist[mlflow]'): test skipped")


def _wandb_history(path: Path) -> dict[int, float]:
    """train/loss by step from a W&B transaction log (run-<id>.wandb: LevelDB log framing, 32 KiB blocks, a CRC-32
    of type + data per chunk, of protobuf Records; wandb ships the Record type but no reader for the file since its
    core moved to Go)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, out = path.read_bytes(), 32768, {}
    pos, pending = 7, b""  # header: ":W&B", magic 0xBEE1, version
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if length == 0 and kind == 0:
            break
        assert zlib.crc32(bytes([kind]) + chunk) == crc, f"{path}: record at {pos} damaged"
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # FULL or LAST: a whole record
            rec = pb.Record()
            rec.ParseFromString(pending)
            if rec.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                if "train/loss" in items:
                    out[int(items["_step"])] = items["train/loss"]
    return out


def test_wandb_offline_and_mlflow_file_store_follow_metrics_and_resume(tmp_path: Path, corpus_dir: Path) -> None:
    run, store = tmp_path / "run", (tmp_path / "mlruns").as_uri()
    over = [
        *SMALL,
        f"run.dir={run}",
        "data.source=files",
        f"data.path={corpus_dir}",
        "train.steps=6",
        "logging.wandb.project=hpcdist-test",
        "logging.wandb.mode=offline",
        f"logging.mlflow.tracking_uri={store}",
        "logging.mlflow.experiment=tests",
    ]
    cfg = config_mod.load(None, over)
    single(train, cfg, 3)  # an interruption: checkpoint at step 3
    ids = json.loads(RunDir(run).trackers.read_text())
    single(train, cfg)  # resumes from step 3
    assert json.loads(RunDir(run).trackers.read_text()) == ids  # the same tracker runs, not new ones

    lines = [json.loads(x) for x in RunDir(run).metrics.read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in lines if "split" not in r}
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]

    client = mlflow.tracking.MlflowClient(tracking_uri=store)
    exp = client.get_experiment_by_name("tests")
    assert [r.info.run_id for r in client.search_runs([exp.experiment_id])] == [ids["mlflow"]["run_id"]]
    history = {m.step: m.value for m in client.get_metric_history(ids["mlflow"]["run_id"], "train/loss")}
    assert history == pytest.approx(losses, rel=1e-12)
    assert client.get_run(ids["mlflow"]["run_id"]).data.params["train.steps"] == "6"  # the resolved config

    runs = sorted(RunDir(run).wandb.glob("offline-run-*"))
    # one W&B run, two attempts; two attempts in the same second share the directory's name and W&B adds "-1"
    # (seen on Python 3.13 in CI, where the attempts are fast enough)
    same_run = re.compile(rf"offline-run-\d{{8}}_\d{{6}}-{re.escape(ids['wandb']['id'])}(-\d+)?")
    assert len(runs) == 2 and all(same_run.fullmatch(r.name) for r in runs), [r.name for r in runs]
    first, second = (_wandb_history(next(r.glob("run-*.wandb"))) for r in runs)
    assert sorted(first) == [1, 2, 3] and sorted(second) == [4, 5, 6]
    assert {**first, **second} == pytest.approx(losses, rel=1e-6)
    # offline: W&B's usage analytics did not start (its two OpenTelemetry export threads outlived wandb.teardown(),
    # posted to the server and were copied by every later fork of this process)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("Otel")]


def test_a_tracker_without_its_package_is_one_line_before_start(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError) as e:
        config_mod.load(None, ["logging.wandb.project=p"])
    assert "logging.wandb.project: needs the wandb package: pip install 'hpcdist[wandb]'" in str(e.value)
    with pytest.raises(ConfigError) as e:
        config_mod.load(None, ["logging.wandb.mode=cloud"])
    assert "logging.wandb.mode: 'cloud' is not one of online, offline, disabled" in str(e.value)
