"""Checkpoint files: reading safetensors, identifying layouts and formats, key maps, loading components."""
