"""Unit tests for hpcdist.metrics and hpcdist.base.logging_utils (CPU only, a few seconds)."""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from hpcdist.base import logging_utils
from hpcdist.base.logging_utils import get_logger, log0, setup_logging
from hpcdist.metrics import throughput
from hpcdist.metrics.logger import MetricsLogger, format_eta, format_line
from hpcdist.metrics.throughput import (
    GPU_PEAK_FLOPS,
    Throughput,
    gpu_peak_flops,
    measure_cpu_peak_flops,
    memory_stats,
    mfu,
    peak_flops,
)

# ---------------------------------------------------------------- peak FLOPs and MFU


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("Tesla V100-SXM2-32GB", 125e12),
        ("nvidia a100-sxm4-40gb", 312e12),  # case-insensitive
        ("NVIDIA A10", GPU_PEAK_FLOPS["A10"]),  # not swallowed by / swallowing "A100"
        ("NVIDIA RTX A1000 6GB Laptop GPU", None),  # "A100" must not match inside "A1000"
        ("NVIDIA GeForce GTX 1080", None),
        ("", None),
    ],
)
def test_gpu_peak_flops_lookup(name: str, expected: float | None) -> None:
    assert gpu_peak_flops(name) == expected


def test_peak_flops_configured_wins() -> None:
    # A configured value must be returned as is, without measuring (CPU) or looking up (CUDA).
    assert peak_flops("cpu", configured=1.5e9) == 1.5e9
    assert peak_flops(torch.device("cuda", 0), configured=2.0e14) == 2.0e14
    with pytest.raises(ValueError, match="peak_flops"):
        peak_flops("cpu", configured=0.0)


def test_peak_flops_cuda_uses_datasheet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert peak_flops("cuda:0") == 312e12


def test_peak_flops_cpu_measures_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def fake_measure(**kwargs: object) -> float:
        calls.append(1)
        return 1.0e10

    monkeypatch.setattr(throughput, "_measured_peaks", {})
    monkeypatch.setattr(throughput, "measure_cpu_peak_flops", fake_measure)
    assert peak_flops("cpu") == 1.0e10
    assert peak_flops(torch.device("cpu")) == 1.0e10
    assert len(calls) == 1  # cached per process


def test_measure_cpu_peak_flops_plausible() -> None:
    flops = measure_cpu_peak_flops(n=256, repeats=3)
    # Any CPU that runs torch does > 100 MFLOP/s on a 256^3 matmul and far less than 1 PFLOP/s.
    assert 1e8 < flops < 1e15


def test_mfu_arithmetic() -> None:
    # 1000 tok/s/device * 6e9 FLOP/token = 6e12 FLOP/s on a 312e12 device.
    assert mfu(1000.0, 6e9, 312e12) == pytest.approx(6e12 / 312e12)
    assert mfu(0.0, 6e9, 312e12) == 0.0
    with pytest.raises(ValueError):
        mfu(1000.0, 6e9, 0.0)


# ---------------------------------------------------------------- throughput


def test_throughput_window() -> None:
    tp = Throughput(world_size=4, window=3)
    assert tp.tokens_per_s == 0.0 and tp.step_time == 0.0  # before any step
    tp.update(1000, 10.0)  # slow first step (compile), pushed out of the window below
    for _ in range(3):
        tp.update(400, 1.0)
    assert tp.tokens_per_s == pytest.approx(400.0)
    assert tp.tokens_per_s_per_device == pytest.approx(100.0)
    assert tp.step_time == pytest.approx(1.0)
    tp.update(800, 3.0)  # window now (400, 1), (400, 1), (800, 3): ratio of sums, not mean of rates
    assert tp.tokens_per_s == pytest.approx(1600 / 5)
    assert tp.step_time == pytest.approx(5 / 3)


def test_throughput_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        Throughput(world_size=0)
    with pytest.raises(ValueError):
        Throughput(world_size=1, window=0)
    with pytest.raises(ValueError):
        Throughput(world_size=1).update(10, -1.0)


# ---------------------------------------------------------------- memory


def test_memory_stats_cpu_positive_rss() -> None:
    stats = memory_stats("cpu")
    assert set(stats) == {"mem_rss_gib"}
    # A process that imported torch holds well over 10 MiB and (here) under 1 TiB.
    assert 0.01 < stats["mem_rss_gib"] < 1024


def test_memory_stats_cuda_reads_and_resets(monkeypatch: pytest.MonkeyPatch) -> None:
    resets: list[object] = []

    class Props:
        total_memory = 80 * 2**30

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 30 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 40 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: Props())
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: resets.append(device))
    stats = memory_stats("cuda:0")
    assert stats == pytest.approx({"mem_alloc_gib": 30.0, "mem_reserved_gib": 40.0, "mem_pct": 50.0})
    assert len(resets) == 1


# ---------------------------------------------------------------- formatting


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [(0, "0s"), (12.4, "12s"), (59.6, "1m00s"), (185, "3m05s"), (3720, "1h02m"), (-5, "0s"), (math.nan, "?")],
)
def test_format_eta(seconds: float, expected: str) -> None:
    assert format_eta(seconds) == expected


def test_format_line_full() -> None:
    line = format_line(
        120,
        200,
        {
            "loss": 2.34561,
            "lr": 2.95e-4,
            "grad_norm": 0.87,
            "tokens_per_s": 12345.0,
            "mfu": 0.412,
            "mem_rss_gib": 1.23,
            "eta_s": 185.0,
        },
    )
    assert (
        line
        == "step 120/200 | loss 2.3456 | lr 2.95e-04 | gnorm 0.87 | tps 12,345 | mfu 41.2% | mem 1.2GiB | eta 3m05s"
    )


def test_format_line_throughput_reads_like_torchtitan() -> None:
    line = format_line(3, 9, {"tokens_per_s": 20561.6, "tokens_per_s_per_device": 5140.4})
    assert line == "step 3/9 | tps 20,562 (5,140/dev)"


def test_format_line_omits_missing() -> None:
    line = format_line(5, 10, {"loss": 1.5})
    assert line == "step 5/10 | loss 1.5000"
    for absent in ("lr", "gnorm", "tps", "mfu", "mem", "eta"):
        assert absent not in line


def test_format_line_gpu_memory_prefers_reserved() -> None:
    line = format_line(1, 2, {"mem_alloc_gib": 30.0, "mem_reserved_gib": 40.0, "mem_pct": 50.0})
    assert "mem 40.0GiB (50%)" in line
    assert "30.0" not in line


# ---------------------------------------------------------------- MetricsLogger

REQUIRED = ("step", "time", "loss", "lr", "grad_norm", "tokens_per_s", "mfu")


def _train_metrics(loss: float) -> dict[str, float]:
    return {"loss": loss, "lr": 3e-4, "grad_norm": 0.5, "tokens_per_s": 1e4, "mfu": 0.4}


def _read_jsonl(path: Path) -> list[dict]:
    # json.loads rejects nothing non-standard by default, so also forbid the NaN/Infinity tokens explicitly.
    def reject(token: str) -> None:
        raise ValueError(f"non-standard JSON token {token}")

    return [json.loads(line, parse_constant=reject) for line in path.read_text().splitlines()]


def test_metrics_logger_jsonl_and_append(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, enabled=True, tensorboard=False) as ml:
        ml.log(1, _train_metrics(3.0))
        ml.log(2, _train_metrics(2.5))
    # A resumed run opens the same directory again and continues the file.
    with MetricsLogger(tmp_path, enabled=True, tensorboard=False) as ml:
        ml.log(3, _train_metrics(2.0))
        ml.log(3, {"loss": 2.2}, prefix="eval")

    rows = _read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 3]
    for row in rows[:3]:
        assert all(k in row for k in REQUIRED)
        assert "split" not in row
    assert rows[0]["loss"] == 3.0 and rows[2]["loss"] == 2.0
    assert rows[3]["split"] == "eval" and rows[3]["loss"] == 2.2
    assert not (tmp_path / "tensorboard").exists()


def test_metrics_logger_flushes_each_line(tmp_path: Path) -> None:
    # Read while the logger is still open: a killed job must not lose buffered lines.
    ml = MetricsLogger(tmp_path, enabled=True, tensorboard=False)
    ml.log(7, {"loss": 1.0})
    assert _read_jsonl(tmp_path / "metrics.jsonl")[0]["step"] == 7
    ml.close()
    ml.close()  # idempotent
    ml.log(8, {"loss": 1.0})  # after close: a no-op, not an error
    assert len(_read_jsonl(tmp_path / "metrics.jsonl")) == 1


def test_metrics_logger_nonfinite_becomes_null(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, enabled=True, tensorboard=False) as ml:
        ml.log(1, {"loss": math.nan, "grad_norm": math.inf, "lr": torch.tensor(1e-3), "mfu": -math.inf})
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    (row,) = _read_jsonl(tmp_path / "metrics.jsonl")
    assert row["loss"] is None and row["grad_norm"] is None and row["mfu"] is None
    assert row["lr"] == pytest.approx(1e-3)  # a 0-d tensor is written as a number


def test_metrics_logger_tensorboard_readback(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, enabled=True) as ml:
        ml.log(10, _train_metrics(2.5))
        ml.log(20, _train_metrics(2.25))
        ml.log(20, {"loss": 2.75}, prefix="eval")
    tb_dir = tmp_path / "tensorboard"
    assert list(tb_dir.glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    assert {"train/loss", "train/lr", "train/mfu", "eval/loss"} <= set(acc.Tags()["scalars"])
    train_loss = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert train_loss == [(10, pytest.approx(2.5)), (20, pytest.approx(2.25))]
    assert acc.Scalars("eval/loss")[0].value == pytest.approx(2.75)


def test_metrics_logger_disabled_writes_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with MetricsLogger(run_dir, enabled=False) as ml:
        ml.log(1, _train_metrics(1.0))
        ml.log(1, {"loss": 1.0}, prefix="eval")
    assert not run_dir.exists()


# ---------------------------------------------------------------- logging_utils


def _owned(logger: logging.Logger) -> list[logging.Handler]:
    """The handlers setup_logging installed (not the ones a test runner or another library added)."""
    return [h for h in logger.handlers if getattr(h, "_hpcdist_owned", False)]


@pytest.fixture
def clean_logger() -> Iterator[logging.Logger]:
    """Restore the hpcdist logger after a test that calls setup_logging."""
    logger = get_logger()
    # Only our own handlers are saved and restored: pytest's log capture attaches and detaches its handlers
    # around every test phase (on non-propagating loggers too, since pytest 9.2), and restoring a snapshot of
    # those would leave stale capture handlers behind for later tests.
    saved = (_owned(logger), logger.level, logger.propagate, logging_utils._rank)
    yield logger
    for handler in _owned(logger):
        logger.removeHandler(handler)
    for handler in saved[0]:
        logger.addHandler(handler)
    logger.setLevel(saved[1])
    logger.propagate = saved[2]
    logging_utils._rank = saved[3]


def test_setup_logging_idempotent(clean_logger: logging.Logger, capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging(0)
    setup_logging(0)
    assert len(_owned(clean_logger)) == 1
    log0("hello %d", 42)
    out = capsys.readouterr().out
    assert out.count("hello 42") == 1
    # ISO date-time, level and rank on every line: [hpcdist 2026-11-25T19:30:01 INFO r0] hello 42
    assert re.fullmatch(r"\[hpcdist \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d INFO r0\] hello 42\n", out), out


def test_setup_logging_other_ranks_warn_only(clean_logger: logging.Logger, capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging(3)
    child = get_logger("hpcdist.trainer")
    child.info("info from rank 3")
    log0("log0 from rank 3")
    child.warning("warning from rank 3")
    out = capsys.readouterr().out
    assert "info from rank 3" not in out
    assert "log0 from rank 3" not in out
    assert "r3] warning from rank 3" in out
    # log0 checks the rank itself, so it stays silent even if someone lowers the level on this rank.
    clean_logger.setLevel(logging.DEBUG)
    log0("log0 after lowering the level")
    child.info("plain info after lowering the level")
    out = capsys.readouterr().out
    assert "log0 after lowering" not in out
    assert "plain info after lowering" in out


def test_setup_logging_level_and_validation(clean_logger: logging.Logger) -> None:
    setup_logging(0, level="debug")
    assert clean_logger.getEffectiveLevel() == logging.DEBUG
    setup_logging(1, level="DEBUG")
    assert clean_logger.getEffectiveLevel() == logging.WARNING
    with pytest.raises(ValueError, match="log level"):
        setup_logging(0, level="LOUD")


def test_throughput_run_average_is_every_step_not_the_window() -> None:
    """The end-of-run "throughput" was the last window's; the run's is every step's tokens over time."""
    tp = Throughput(world_size=1, window=2)
    for tokens, seconds in ((100, 10.0), (400, 1.0), (400, 1.0)):
        tp.update(tokens, seconds)
    assert tp.tokens_per_s == pytest.approx(400.0) and tp.run_tokens_per_s == pytest.approx(900 / 12)


@pytest.mark.parametrize("second_peak", [1e12, 1e3], ids=["measured-again", "capped"])
def test_mfu_over_a_peak_measured_under_load_is_measured_again_or_capped(
    tmp_path: Path, corpus_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, second_peak
) -> None:
    """MFU read 126% when the CPU peak, measured once at start while the machine was loaded, was too low.
    A run that beats its measured peak measures it again (the higher one kept); still beaten: capped at 100%."""
    from hpcdist import run
    from tests.conftest import SMALL

    peaks = iter([1e3, second_peak])  # 1 kFLOP/s: a peak measured while something else had the machine
    monkeypatch.setattr(throughput, "_measured_peaks", {})
    monkeypatch.setattr(throughput, "measure_cpu_peak_flops", lambda **kw: next(peaks))
    over = [*SMALL, f"run.dir={tmp_path}", "data.source=files", f"data.path={corpus_dir}", "train.steps=3"]
    run.main(None, [*over, "logging.peak_flops=null"])
    mfus = [
        json.loads(line)["mfu"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"mfu"' in line
    ]
    assert len(mfus) == 3 and all(0 < m <= 1.0 for m in mfus), mfus
    capped = [r for r in caplog.records if "capped at 100%" in r.getMessage()]
    assert len(capped) == (1 if second_peak == 1e3 else 0)
    if second_peak == 1e12:
        assert max(mfus) < 0.5  # against the peak measured again, not the cap
