"""``python -m flashloop_compile``: the ``flashloop-compile`` command line."""

import sys

from flashloop_compile.cli import main

sys.exit(main())
