"""Stream a growing log file until a job ends: `hpcdist logs JOB --follow` and `hpcdist submit --wait`.

``tail -f`` does not know when the job ends, and a requeued job starts its log file again (SLURM truncates it), which
``tail -f`` shows as nothing at all. Here the job's state decides when to stop, the file's end is read once more
after the job ended (nothing written at the last moment is lost), and a truncated file is read from its start.
"""

from __future__ import annotations

import codecs
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

__all__ = ["follow"]


def follow(
    path: Callable[[], Path | None],
    finished: Callable[[], bool],
    out: TextIO,
    *,
    poll_s: float = 1.0,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Copy what is appended to ``path()`` (None or missing: not there yet) to ``out`` until ``finished()``."""
    pos = 0
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character split across two reads
    while True:
        done = finished()  # asked before the last read: what the job wrote before it ended is read below
        p = path()
        try:
            size = p.stat().st_size if p is not None else None
        except OSError:
            size = None
        if p is not None and size is not None:
            if size < pos:
                out.write(f"[hpcdist logs] {p} started again (a requeued attempt); from its start:\n")
                pos = 0
                decoder.reset()
            if size > pos:
                with p.open("rb") as f:
                    f.seek(pos)
                    data = f.read(size - pos)
                pos += len(data)
                out.write(decoder.decode(data))
                out.flush()
        if done:
            return
        sleep(poll_s)
