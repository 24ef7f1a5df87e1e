"""Entry point: `python -m vitpod.workflows <command> ...` (see workflows/cli.py for the commands)."""

import sys

from vitpod.workflows.cli import main

sys.exit(main())
