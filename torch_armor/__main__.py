"""``python -m torch_armor prune | eval | demo`` (same as the ``torch-armor`` command)."""

import sys

from torch_armor.cli.parser import main

if __name__ == "__main__":
    sys.exit(main())
