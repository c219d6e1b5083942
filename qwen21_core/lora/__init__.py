"""LoRA for the Qwen-Image-2.1 DiT: read adapter files in the common key formats (keys.py, reading.py) and merge
them into the transformer's weights in place, exactly reversibly (merge.py); the files read lately are kept
(files.py)."""
