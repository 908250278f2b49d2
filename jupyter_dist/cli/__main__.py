"""``python -m jupyter_dist.cli``: the ``jupyter-dist`` console script."""

import sys

from . import main

sys.exit(main())
