"""``python -m rollhpc.cli``: the same as the ``rollhpc`` command."""

import sys

from rollhpc.cli import main

sys.exit(main())
