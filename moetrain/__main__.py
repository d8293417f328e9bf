"""``python -m moetrain`` is the same program as the ``moetrain`` command."""

import sys

from moetrain.cli import main

sys.exit(main())
