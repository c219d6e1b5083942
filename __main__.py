"""`python -m qwen21_nodes {run, demo, make-tiny}`: see runner/cli.py."""

import sys

from .runner.cli import main

sys.exit(main())
