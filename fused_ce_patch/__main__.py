"""``python -m fused_ce_patch``: see :mod:`fused_ce_patch.cli`."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
