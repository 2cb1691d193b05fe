"""``python -m mpicomm info`` / ``python -m mpicomm run -n N command...`` (see :mod:`.cli`)."""

import os
import sys

from .cli import main

if __name__ == "__main__":
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:  # the reader left (``... | head``): no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 1
    sys.exit(code)
