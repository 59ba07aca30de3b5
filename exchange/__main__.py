"""``python -m exchange``: the ``tensor-exchange`` command line (see exchange/cli/__init__.py)."""

import sys

from .cli import main

sys.exit(main())
