"""Experiment trackers, rank 0 only: Weights & Biases (``logging.wandb``) and MLflow (``logging.mlflow``).

Both get what metrics.jsonl gets, under the same keys (``train/loss``, ``eval/loss``, ``goodput/train``, ...: the
TensorBoard tags), at the same steps, and the resolved config as the run's config. A resumed attempt continues the
same tracker run: the run ids are kept in <run.dir>/trackers.json, written when the run is created. Steps computed
again after a restart are logged again; W&B keeps the first value of a step it has already seen (it refuses steps
that go back), MLflow keeps both (metrics.jsonl's readers keep the last line per step).

The packages are optional extras (``pip install 'hpcdist[wandb]'``, ``'hpcdist[mlflow]'``) imported only when a
tracker is configured; the config check refuses a tracker whose package is missing before any process starts.
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpcdist.base.atomic import atomic_write
from hpcdist.base.logging_utils import get_logger
from hpcdist.base.rundir import RunDir

__all__ = ["Trackers", "load_ids"]

log = get_logger(__name__)


def load_ids(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        data = json.loads(RunDir(run_dir).trackers.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _save_id(run_dir: Path, name: str, value: Mapping[str, Any]) -> None:
    data = load_ids(run_dir)
    data[name] = dict(value)
    atomic_write(RunDir(run_dir).trackers, json.dumps(data, indent=1))


def _numbers(metrics: Mapping[str, Any], prefix: str) -> dict[str, float]:
    """``{prefix}/{key}: value`` for the finite numbers (lists and nulls stay in metrics.jsonl only)."""
    out = {}
    for key, value in metrics.items():
        value = value.item() if hasattr(value, "item") and callable(value.item) else value
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[f"{prefix}/{key}"] = float(value)
    return out


def _flat(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


class _Wandb:
    def __init__(self, cfg: Any, run_dir: Path, config: dict[str, Any]) -> None:
        import wandb

        w = cfg.logging.wandb
        ids = load_ids(run_dir).get("wandb", {})
        run_id = ids.get("id") or uuid.uuid4().hex[:16]  # W&B ids: [a-z0-9], unique within the project
        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True)
        if w.mode == "offline":
            # offline means nothing leaves the machine: W&B's process-wide settings (not the run's) decide whether
            # its usage analytics start two OpenTelemetry export threads, which wandb.teardown() leaves running
            # (posting to the server, and copied by every later fork of this process)
            wandb.setup(settings=wandb.Settings(mode="offline"))
        self.run = wandb.init(
            project=w.project,
            entity=w.entity,
            name=w.name or cfg.run.name,
            mode=w.mode,
            dir=str(run_dir),
            id=run_id,
            resume="allow",
            config=config,
            settings=settings,
        )
        if not ids:
            _save_id(run_dir, "wandb", {"id": run_id, "project": w.project})
        log.info("W&B run %s (%s, project %s)%s", run_id, w.mode, w.project, " resumed" if ids else "")

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self, *, failed: bool = False) -> None:
        import wandb

        self.run.finish(exit_code=1 if failed else 0)
        # and stop W&B's service process and its threads: a later fork (the next test's ranks, a prefetch worker)
        # must not copy a thread that holds a lock
        wandb.teardown()


class _Mlflow:
    def __init__(self, cfg: Any, run_dir: Path, config: dict[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        m = cfg.logging.mlflow
        if "://" not in m.tracking_uri or m.tracking_uri.startswith("file:"):
            # MLflow 3 refuses its file store unless asked for; a configured file: URI is that request (the store
            # on a shared file system is what a cluster without a tracking server has)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=m.tracking_uri)
        ids = load_ids(run_dir).get("mlflow", {})
        if ids.get("run_id"):
            self.run_id = ids["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            exp = self.client.get_experiment_by_name(m.experiment)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(m.experiment)
            self.run_id = self.client.create_run(exp_id, run_name=cfg.run.name).info.run_id
            # params once, at creation: MLflow refuses to change a param, and a resume may change a few keys
            flat = _flat(config)
            keys = sorted(flat)
            for i in range(0, len(keys), 100):  # the log_batch limit on params
                batch = [Param(k, str(flat[k])[:6000]) for k in keys[i : i + 100]]
                self.client.log_batch(self.run_id, params=batch)
            self.client.log_dict(self.run_id, config, "config.json")
            _save_id(
                run_dir, "mlflow", {"run_id": self.run_id, "experiment_id": exp_id, "tracking_uri": m.tracking_uri}
            )
        log.info("MLflow run %s at %s%s", self.run_id, m.tracking_uri, " resumed" if ids else "")

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(1000 * time.time())
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def close(self, *, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


class Trackers:
    """The configured trackers on rank 0; nothing elsewhere. A tracker that fails is switched off with a warning:
    losing a dashboard must not stop a training run (metrics.jsonl has everything)."""

    def __init__(self, cfg: Any, run_dir: str | os.PathLike[str], *, enabled: bool, config: dict[str, Any]) -> None:
        self._sinks: list[Any] = []
        if not enabled:
            return
        lg, root = cfg.logging, Path(run_dir)
        wanted = []
        if lg.wandb.project and lg.wandb.mode != "disabled":
            wanted.append(("W&B", _Wandb))
        if lg.mlflow.tracking_uri:
            wanted.append(("MLflow", _Mlflow))
        for name, kind in wanted:
            try:
                self._sinks.append(kind(cfg, root, config))
            except Exception as e:
                log.warning("%s disabled: %s: %s", name, type(e).__name__, e)

    def log(self, step: int, metrics: Mapping[str, Any], prefix: str = "train") -> None:
        if not self._sinks:
            return
        values = _numbers(metrics, prefix)
        for sink in list(self._sinks):
            try:
                sink.log(step, values)
            except Exception as e:
                log.warning("%s disabled after an error: %s: %s", type(sink).__name__.strip("_"), type(e).__name__, e)
                self._sinks.remove(sink)

    def close(self, *, failed: bool = False) -> None:
        """``failed``: the training raised; each tracker records its run as failed, not finished."""
        for sink in self._sinks:
            try:
                sink.close(failed=failed)
            except Exception as e:
                log.warning("closing %s: %s", type(sink).__name__.strip("_"), e)
        self._sinks = []
