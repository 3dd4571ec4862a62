"""Hugging Face export / import benchmark: wall time and peak memory of ``hpcdist export`` and ``hpcdist import``.

    python tools/bench/hf_export.py                          # 1.3b preset, ~5 GB of fp32 weights; ~5-10 min here
    python tools/bench/hf_export.py --preset 125m            # quick
    python tools/bench/hf_export.py --dir /scratch/me --max-shard-size 2GB --json runs/bench/hf.json

Each phase runs in a process of its own, so one phase's memory never counts in another's:

1. save: the preset's initialized weights (no optimizer) saved through the real CheckpointManager as a DCP
   checkpoint, with the trainer state that names the model (what a trained run's checkpoint holds besides moments).
2. export bf16 and export fp32 with ``--max-shard-size``: streamed from DCP one FQN at a time.
3. import of the bf16 export: a float32 step-0 checkpoint, one tensor at a time through DCP's writer.

Each phase reports its process baseline (RSS after its imports, before any work), its peak RSS (getrusage
ru_maxrss) and its wall time. The goal for the export: peak RSS < baseline + 1.5 x the largest output shard; for the
import, the output is one DCP file per rank written tensor by tensor, so the reference is the largest tensor
(goal: peak < baseline + 1.5 x the largest output shard, taken as the bf16 export's for comparison, and reported
against the largest tensor too). Numbers go to stdout as a table and to ``--json``; goals are reported, never
enforced.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GB = 1e9


def _rss_now() -> int:
    """Resident set size of this process now, bytes (/proc/self/status VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def phase_save(preset: str, out: Path) -> dict[str, Any]:
    import torch

    from hpcdist.checkpoint.manager import CheckpointManager
    from hpcdist.checkpoint.state import Checkpointable
    from hpcdist.models.args import ModelArgs, load_preset
    from hpcdist.models.llama import build_model

    base = _rss_now()
    t0 = time.perf_counter()
    args = ModelArgs(**load_preset(preset))
    torch.manual_seed(0)
    model = build_model(args, "cpu")
    state = {"model": dict(model.state_dict())}
    trainer_state = {
        "step": 0,
        "tokens_seen": 0,
        "world_size": 1,
        "config": {"model": dataclasses.asdict(args), "data": {"source": "stdlib"}},
    }
    ckpt = Checkpointable(
        dcp_state=lambda: state,
        load_dcp_state=lambda _: None,
        trainer_state=lambda: trainer_state,
        load_trainer_state=lambda _: None,
    )
    path = CheckpointManager(out, rank=0, world_size=1).save(0, ckpt)
    largest = max(t.nbytes for t in state["model"].values())
    return {
        "seconds": time.perf_counter() - t0,
        "baseline": base,
        "peak": _peak(),
        "path": str(path),
        "weights_bytes": sum(t.nbytes for t in state["model"].values()),
        "largest_tensor": largest,
    }


def phase_export(ckpt: Path, out: Path, dtype: str, max_shard: str) -> dict[str, Any]:
    from hpcdist.hf.export import export, parse_shard_size

    base = _rss_now()
    res = export(ckpt, out, dtype=dtype, max_shard_size=parse_shard_size(max_shard))
    return {
        "seconds": res.seconds,
        "baseline": base,
        "peak": _peak(),
        "largest_shard": res.largest_shard_bytes,
        "total_bytes": res.total_bytes,
        "files": res.files,
    }


def phase_import(hf: Path, out: Path) -> dict[str, Any]:
    from hpcdist.hf.import_ import import_checkpoint

    base = _rss_now()
    t0 = time.perf_counter()
    path = import_checkpoint(hf, out)
    size = sum(f.stat().st_size for f in path.glob("*.distcp"))
    return {"seconds": time.perf_counter() - t0, "baseline": base, "peak": _peak(), "total_bytes": size}


def _child(*argv: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"phase {argv[1]} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="1.3b")
    p.add_argument("--dir", type=Path, default=None, help="work directory (default: a temp dir, removed after)")
    p.add_argument("--max-shard-size", default="2GB")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--phase", help=argparse.SUPPRESS)
    p.add_argument("paths", nargs="*", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.phase:  # a child: one phase, its numbers as the last stdout line
        if a.phase == "save":
            out = phase_save(a.preset, Path(a.paths[0]))
        elif a.phase == "export":
            out = phase_export(Path(a.paths[0]), Path(a.paths[1]), a.paths[2], a.max_shard_size)
        else:
            out = phase_import(Path(a.paths[0]), Path(a.paths[1]))
        print(json.dumps(out))
        return 0
    work = a.dir or Path(tempfile.mkdtemp(prefix="hf-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        saved = _child("--phase", "save", "--preset", a.preset, str(work / "ckpt"))
        rows = {"save (DCP, fp32)": saved}
        for dtype in ("bf16", "fp32"):
            rows[f"export {dtype}"] = _child(
                "--phase",
                "export",
                "--max-shard-size",
                a.max_shard_size,
                saved["path"],
                str(work / f"hf-{dtype}"),
                dtype,
            )
        rows["import (bf16 dir)"] = _child("--phase", "import", str(work / "hf-bf16"), str(work / "imported"))
    finally:
        if a.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    bf16_shard = rows["export bf16"]["largest_shard"]
    print(
        f"\n{a.preset}: {saved['weights_bytes'] / GB:.2f} GB of fp32 weights, largest tensor "
        f"{saved['largest_tensor'] / GB:.3f} GB, --max-shard-size {a.max_shard_size}\n"
    )
    head = (
        f"{'phase':<20} {'wall s':>7} {'baseline GB':>12} {'peak GB':>8} {'largest shard GB':>17} "
        f"{'(peak-base)/shard':>18} {'goal < 1.5':>10}"
    )
    print(head)
    print("-" * len(head))
    for name, r in rows.items():
        shard = r.get("largest_shard") or (bf16_shard if name.startswith("import") else None)
        ratio = (r["peak"] - r["baseline"]) / shard if shard else None
        print(
            f"{name:<20} {r['seconds']:>7.1f} {r['baseline'] / GB:>12.2f} {r['peak'] / GB:>8.2f} "
            f"{(shard or 0) / GB:>17.2f} {'' if ratio is None else f'{ratio:.2f}':>18} "
            f"{'' if ratio is None else ('yes' if ratio < 1.5 else 'NO'):>10}"
        )
    imp = rows["import (bf16 dir)"]
    print(
        f"\nimport: peak - baseline = {(imp['peak'] - imp['baseline']) / saved['largest_tensor']:.2f} x the "
        "largest tensor (it writes one tensor at a time; its shard column is the bf16 export's, for comparison)"
    )
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        report = {"preset": a.preset, "max_shard_size": a.max_shard_size, "phases": rows}
        a.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
