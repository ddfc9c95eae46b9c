"""`python -m graphpass inspect ...`: the same as the `graphpass` command."""

import sys

from graphpass.cli import main

sys.exit(main())
