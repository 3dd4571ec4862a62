"""``python -m hpcdist.launch.failures after-step``: the old name of ``python -m hpcdist.launch.restarts``, kept for
batch scripts written by an earlier hpcdist (a requeued job runs the script it was submitted with)."""

from __future__ import annotations

import sys

from hpcdist.launch.restarts import main

if __name__ == "__main__":
    sys.exit(main())
