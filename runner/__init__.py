"""The in-process workflow runner behind `python -m qwen21_nodes run` (no ComfyUI needed)."""
