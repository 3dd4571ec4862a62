"""`--help` of every tool answers without importing torch or DeepSpeed.

Importing torch takes 5-60 s on a busy 2-core machine; a user asking a tool what it takes should wait no longer
than for `hpcdist train --help`. Each tool runs as its own `__main__` (runpy, as `python tools/...` would run it)
in one fresh interpreter, and the modules it imported are checked after each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# the executables in tools/ and every bench script
TOOLS = sorted(p for p in (REPO / "tools").iterdir() if p.is_file() and os.access(p, os.X_OK))
TOOLS += sorted((REPO / "tools" / "bench").glob("*.py"))
HEAVY = ("torch", "deepspeed")

# Runs every tool's --help in this one interpreter; prints {tool: [heavy modules imported, exit code, help chars]}.
_DRIVER = """
import contextlib, io, json, os, runpy, sys
heavy, out = sys.argv[1].split(","), {}
for path in sys.argv[2:]:
    sys.argv = [path, "--help"]
    sys.path.insert(0, os.path.dirname(path))  # as `python PATH` does: the benches import pagecache
    buf = io.StringIO()
    code = None
    with contextlib.redirect_stdout(buf):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as e:
            code = e.code
    out[path] = [sorted(m for m in heavy if m in sys.modules), code, len(buf.getvalue())]
    if out[path][0]:
        break  # later tools would be measured with torch already loaded
print(json.dumps(out))
"""


def test_every_tool_answers_help_without_importing_torch() -> None:
    names = [p.name for p in TOOLS]
    assert {"nccl_check", "deepspeed_configs", "slurm_sandbox", "scaling.py"} <= set(names), names
    tools = [p for p in TOOLS if p.name != "pagecache.py"]  # a helper module of the benches, not a tool
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER, ",".join(HEAVY), *map(str, tools)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    for path in tools:
        heavy, code, chars = result.get(str(path), [None, None, 0])
        assert heavy == [], f"{path.relative_to(REPO)} --help imported {heavy}"
        assert code == 0 and chars > 100, f"{path.relative_to(REPO)} --help: exit {code}, {chars} chars of help"
