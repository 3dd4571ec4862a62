"""The README's timings, measured on this machine: the install and the main job of its first lines.

README.md states how long ``pip install torch==2.13.0 -e ".[test]"`` and ``hpcdist train configs/demo.yaml``
take. This script measures both as a new user runs them and prints the numbers with the date, the machine's core
count and CPU, and the load average before and after (another process on a shared machine makes both slower: the
load says whether the numbers are a quiet machine's):

1. **install** -- a fresh virtualenv in a temporary directory and ``pip install torch==2.13.0 -e "REPO[test]"``
   (pip's cache as it is on this machine: a first install that downloads torch takes longer).
2. **main job** -- ``hpcdist train configs/demo.yaml`` (300 steps of the 2.9M-parameter model on this interpreter's
   standard library, one process), in a temporary run directory, with this checkout's hpcdist. Reported: the wall
   time from the command's start to its exit, the run's average tokens/s and MFU (run_summary.json and the last
   metrics line; MFU against the CPU peak the run measured), and the ETA its first log line predicted.

Run from the repository root::

    python tools/bench/readme_timings.py                 # both: ~4-8 min on a quiet 2-core machine
    python tools/bench/readme_timings.py --skip-install  # the main job only
    python tools/bench/readme_timings.py --steps 30      # a shorter job: the 300-step time is extrapolated (said so)

Standard library only (``--help`` imports no torch); the numbers also go to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STEPS = 300  # configs/demo.yaml's train.steps


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def _clock(seconds: float) -> str:
    minutes, s = divmod(round(seconds), 60)
    return f"{minutes} min {s:02d} s" if minutes else f"{s} s"


def measure_install(work: Path) -> dict[str, float | str]:
    venv = work / "venv"
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    t_venv = time.monotonic() - t0
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "torch==2.13.0", "-e", f"{REPO}[test]"]
    proc = subprocess.run(pip, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"readme_timings: pip install failed:\n{proc.stderr[-2000:]}")
    return {"install_s": time.monotonic() - t0, "venv_s": t_venv, "command": " ".join(pip[2:])}


def measure_main_job(work: Path, steps: int) -> dict[str, float | str | None]:
    run_dir = work / "runs" / "demo"
    cmd = [sys.executable, "-m", "hpcdist", "train", str(REPO / "configs" / "demo.yaml"), f"run.dir={run_dir}"]
    if steps != STEPS:
        cmd.append(f"train.steps={steps}")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"readme_timings: the main job failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}")
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"mfu"' in x]
    summary = json.loads((run_dir / "run_summary.json").read_text())
    eta = re.search(r"eta (\S+)", proc.stdout)
    return {
        "wall_s": wall,
        "steps": steps,
        "wall_300_s": wall if steps == STEPS else None,
        "tokens_per_s": summary.get("tokens_per_s"),
        "mfu_last": lines[-1]["mfu"] if lines else None,
        "first_eta": eta.group(1) if eta else None,
        "done": next((x for x in proc.stdout.splitlines() if x.startswith("done:")), ""),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-install", action="store_true", help="measure the main job only")
    parser.add_argument("--skip-job", action="store_true", help="measure the install only")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"steps of the main job (default {STEPS})")
    parser.add_argument("--json", default="runs/bench/readme_timings.json", help="where the numbers go")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    result: dict[str, object] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cores": os.cpu_count(),
        "cpu": _cpu_model(),
        "load_before": _load(),
    }
    print(f"readme_timings {result['date']}: {result['cores']} cores ({result['cpu']}), load {result['load_before']}")
    with tempfile.TemporaryDirectory(prefix="hpcdist-readme-timings-") as tmp:
        work = Path(tmp)
        if not args.skip_install:
            inst = measure_install(work)
            result["install"] = inst
            print(f"install  {inst['command']}: {_clock(float(inst['install_s']))} (venv {inst['venv_s']:.1f} s)")
        if not args.skip_job:
            job = measure_main_job(work, args.steps)
            result["main_job"] = job
            wall = float(job["wall_s"])  # type: ignore[arg-type]
            scaled = "" if args.steps == STEPS else f" -> {_clock(wall * STEPS / args.steps)} for 300 (extrapolated)"
            print(
                f"main job hpcdist train configs/demo.yaml ({args.steps} steps): {_clock(wall)}{scaled}, "
                f"{job['tokens_per_s'] or 0:,.0f} tokens/s, MFU {100 * float(job['mfu_last'] or 0):.0f}% of the "
                f"measured CPU peak; first ETA line {job['first_eta']}; {job['done']}"
            )
    result["load_after"] = _load()
    print(f"load after {result['load_after']}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
