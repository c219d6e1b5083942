"""Thin ComfyUI node classes (V1 API). No model math here."""

NODE_CLASS_MAPPINGS: dict = {}
NODE_DISPLAY_NAME_MAPPINGS: dict = {}
