"""Each rank raises its soft open-file limit to the hard one at start-up: a job inherits the login shell's soft
``ulimit -n`` (often 1024), and a rank holds shards, sockets and staging buffers at once."""

from __future__ import annotations

import logging
import resource

from hpcdist.run import raise_open_file_limit


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_the_soft_open_file_limit_is_raised_to_the_hard_one() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    said, logger = _Lines(), logging.getLogger("hpcdist.run")
    level = logger.level
    logger.addHandler(said)
    logger.setLevel(logging.INFO)
    try:
        before, after = raise_open_file_limit()
        want = hard if hard != resource.RLIM_INFINITY else 1 << 20
        assert (before, after) == (256, want) and resource.getrlimit(resource.RLIMIT_NOFILE) == (want, hard)
        assert any("ulimit -n 256 ->" in line for line in said.lines), said.lines
        assert raise_open_file_limit() == (want, want)  # already there: nothing to do
    finally:
        logger.removeHandler(said)
        logger.setLevel(level)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
