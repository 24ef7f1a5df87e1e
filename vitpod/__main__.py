"""`python -m vitpod <command>`: the login-node commands (the `vitpod` console script)."""

import sys

from vitpod.workflows.cli import main

sys.exit(main())
