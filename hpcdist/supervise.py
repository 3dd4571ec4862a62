"""``python -m hpcdist.supervise``: the old name of ``python -m hpcdist.fault.supervise``, kept for batch scripts
written by an earlier hpcdist (a requeued job runs the script it was submitted with). Standard library only."""

from __future__ import annotations

import sys

from hpcdist.fault.supervise import main

if __name__ == "__main__":
    sys.exit(main())
