"""configs/deepspeed/*.json are what hpcdist generates from YAML, never hand-edited copies."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
from pathlib import Path

import pytest

from hpcdist.parallel.zero import deepspeed_config

ROOT = Path(__file__).resolve().parents[3]
TOOL = ROOT / "tools" / "deepspeed_configs"


def _tool():
    loader = importlib.machinery.SourceFileLoader("deepspeed_configs", str(TOOL))
    spec = importlib.util.spec_from_loader("deepspeed_configs", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_committed_examples_match_the_generator(capsys) -> None:
    # in this process (the tool's main, as `tools/deepspeed_configs --check` runs it): a second interpreter
    # importing torch and hpcdist again cost 4-26 s and tested nothing more
    assert _tool().main(["--check"]) == 0, capsys.readouterr()


def test_check_detects_a_stale_file(tmp_path: Path, monkeypatch) -> None:
    tool = _tool()
    monkeypatch.setattr(tool, "OUT", tmp_path)
    assert tool.main([]) == 0 and tool.main(["--check"]) == 0
    victim = tmp_path / "zero2_13b_32gpu.json"
    ds = json.loads(victim.read_text())
    ds["gradient_accumulation_steps"] += 1  # a hand edit
    victim.write_text(json.dumps(ds, indent=2, sort_keys=True) + "\n")
    assert tool.main(["--check"]) == 1


def test_examples_agree_with_the_train_section() -> None:
    for path in sorted((ROOT / "configs" / "deepspeed").glob("*.json")):
        ds = json.loads(path.read_text())
        # train_13b.yaml: global batch 256 = micro-batch x accumulation x 32 ranks, clip 1.0, bf16 on GPU
        assert (
            ds["train_batch_size"]
            == 256
            == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 32
        ), path.name
        assert ds["gradient_clipping"] == 1.0 and ds["bf16"]["enabled"] is True, path.name
        # bf16 weights, gradients reduced over the 32 ranks in fp32 (8 mantissa bits would sum them otherwise)
        assert ds["communication_data_type"] == "fp32", path.name
        assert "optimizer" not in ds  # hpcdist hands DeepSpeed torch's AdamW: no fused_adam / cpu_adam build


@pytest.mark.parametrize(
    ("stage", "offload", "accum"),
    # stage 1 without offload: fp32 accumulation would make DeepSpeed swap its ZeRO optimizer for BF16_Optimizer
    [(1, False, None), (1, True, "fp32"), (2, False, "fp32"), (2, True, "fp32"), (3, False, "fp32")],
)
def test_bf16_reduces_and_accumulates_gradients_in_fp32(stage: int, offload: bool, accum: str | None) -> None:
    common = {
        "stage": stage,
        "micro_batch_size": 1,
        "grad_accum": 4,
        "dp_size": 32,
        "grad_clip": 1.0,
        "offload_optimizer": offload,
        "offload_params": False,
        "overlap_comm": True,
        "buckets": (100, 200),
    }
    ds = deepspeed_config(bf16=True, **common)
    assert ds["communication_data_type"] == "fp32"
    assert ds.get("data_types", {}).get("grad_accum_dtype") == accum
    for other in (deepspeed_config(bf16=False, **common), deepspeed_config(bf16=False, fp16=True, **common)):
        # fp32: DeepSpeed reduces in fp32 anyway; fp16: its loss scaler's overflow check reads fp16 gradients
        assert "communication_data_type" not in other and "data_types" not in other
