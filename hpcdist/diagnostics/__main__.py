"""``python -m hpcdist.diagnostics``: the nccl_check command (tools/nccl_check is the same)."""

import sys

from hpcdist.diagnostics.cli import main

sys.exit(main())
