"""``python -m diloco.cli``: the ``diloco`` command."""

import sys

from diloco.cli import main

sys.exit(main())
