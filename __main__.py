"""`python -m qwen21_nodes {run, demo, make-tiny}` (the `qwen21-nodes` command is the same): see runner/cli.py."""

import sys
from pathlib import Path

# `python -m` from the clone puts the clone first on sys.path, where our kernels/ would shadow the `kernels`
# package that transformers imports: the pack's own folder is never an import root.
sys.path[:] = [root for root in sys.path if Path(root).resolve() != Path(__file__).resolve().parent]

from .runner.cli import main  # noqa: E402 - after the path is put right

sys.exit(main())
