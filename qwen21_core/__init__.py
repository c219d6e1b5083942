"""The Qwen-Image-2.1 model and everything around it. Never imports ComfyUI."""
