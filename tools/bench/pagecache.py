"""Shared by the benchmarks: make the next read of some files come from the disk, not the page cache."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def drop_page_cache(files: Iterable[Path]) -> None:
    """Best effort: flush each file and ask the kernel to forget its cached pages (these files only)."""
    for f in files:
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
