"""`python -m stride ...`: the `stride` command, where the scripts folder is not on PATH."""

import sys

from stride.server.cli import main

sys.exit(main())
