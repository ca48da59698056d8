"""``python -m fxsplit bench ...``: the same as the ``fxsplit`` console script."""

import sys

from fxsplit.cli import main

sys.exit(main())
