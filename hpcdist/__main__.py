import sys

from hpcdist.cli import main

sys.exit(main())
