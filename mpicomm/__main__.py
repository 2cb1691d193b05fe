"""``python -m mpicomm info`` / ``python -m mpicomm run -n N command...`` (see :mod:`.cli`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
