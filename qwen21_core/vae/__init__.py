"""The RGBA VAE: exact model (model.py), fast paths (fast.py, registered as quality "fast"), tiling and
memory planning (tiling.py), and the pipeline's decode and encode calls (calls.py)."""

from . import fast as _fast  # noqa: F401  (registers quality="fast" with the model)
