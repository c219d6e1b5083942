"""What every benchmark script shares: JSON-line output, device synchronisation, and the tests' diffusers
adapters (tests/dit_reference.py), so a benchmark calls the reference exactly as the parity tests do."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def emit(**fields):
    """One JSON line on stdout, flushed (the logs are read while a run is still going)."""
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
