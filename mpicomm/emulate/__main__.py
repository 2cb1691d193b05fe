"""``python -m mpicomm.emulate ...``: same as ``launchers/emulated-cluster``."""

import sys

from .run import main

sys.exit(main())
