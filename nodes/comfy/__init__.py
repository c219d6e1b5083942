"""The door to ComfyUI's own types: our engine as a MODEL (model.py, its patcher in patcher.py, a sampling run in
sampling.py), our VAE as a VAE (vae.py), our conditionings as CONDITIONING (conditioning.py) and ComfyUI's empty
latents sized for it (latents.py). Every module here but conditioning.py imports ComfyUI: they are imported only
inside a ComfyUI server (nodes/memory_adapter.py, nodes/model.py)."""
