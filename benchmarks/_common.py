"""What every benchmark script shares: JSON-line output and device synchronisation."""

import json
import sys

import torch


def emit(**fields):
    """One JSON line on stdout, flushed (the logs are read while a run is still going)."""
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
