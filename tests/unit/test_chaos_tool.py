"""tools/chaos's schedule and refusals (the campaign itself runs in tests/slurm/test_chaos_slurm.py)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "chaos"


def _chaos():
    loader = importlib.machinery.SourceFileLoader("chaos_tool", str(TOOL))
    spec = importlib.util.spec_from_loader("chaos_tool", loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def test_the_schedule_is_seeded_with_every_kind_and_one_gate() -> None:
    chaos = _chaos()
    short = chaos.schedule(6, 1, list(chaos.KINDS), short=True)
    assert len(short) == 6 and len(set(short)) == 6 and sum(k in chaos.REQUEUE_KINDS for k in short) == 1
    long = chaos.schedule(20, 7, list(chaos.KINDS), short=False)
    assert long == chaos.schedule(20, 7, list(chaos.KINDS), short=False)  # the seed decides
    assert len(long) == 20 and set(long) == set(chaos.KINDS) and long.count("gate") == 1
    assert chaos.schedule(20, 8, list(chaos.KINDS), short=False) != long


def test_bad_arguments_are_one_line_and_exit_2(tmp_path: Path) -> None:
    for args, key in ((["--kinds", "kill,meteor"], "--kinds"), (["--faults", "0"], "--faults")):
        p = subprocess.run(
            [sys.executable, str(TOOL), "--data", str(tmp_path), *args], capture_output=True, text=True, timeout=60
        )
        assert p.returncode == 2 and key in p.stderr and "Traceback" not in p.stderr, p.stderr
