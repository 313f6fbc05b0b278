"""``python -m autotune``: the ``autotune`` command, from a checkout that is not installed (a GPU image)."""

import sys

from autotune.cli import main

if __name__ == "__main__":
    sys.exit(main())
