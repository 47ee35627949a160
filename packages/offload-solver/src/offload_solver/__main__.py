"""``python -m offload_solver``: the ``offload-solve`` CLI."""

import sys

from offload_solver.cli import main

sys.exit(main())
