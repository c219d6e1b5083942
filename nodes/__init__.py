"""Thin ComfyUI node classes (V1 API). No model math here: every node calls the core pipeline.

Each node module is imported on its own, so one that fails (a missing optional dependency, say) is
logged and leaves the others working. Importing them starts nothing: start-up work begins when a model loads
(qwen21_core/startup/).
"""

import importlib
import inspect
import logging

log = logging.getLogger(__name__)

# module -> {class name: display name}; class names carry the Qwen21 prefix so they never clash with core.
_NODES = {
    "loader": {
        "Qwen21ModelLoader": "Qwen21 Load Model (3 files)",
        "Qwen21DiffusersLoader": "Qwen21 Load Diffusers Folder",
    },
    "lora": {"Qwen21LoraLoader": "Qwen21 Load LoRA"},
    "control": {
        "Qwen21ControlLoader": "Qwen21 Load Fun Control",
        "Qwen21ApplyControl": "Qwen21 Apply Fun Control",
        "Qwen21ApplyControlModel": "Qwen21 Apply Fun Control (MODEL)",
    },
    "encode": {"Qwen21Encode": "Qwen21 Encode Prompt + Images"},
    "sample": {"Qwen21Sampler": "Qwen21 Sampler"},
    "schedule": {"Qwen21Scheduler": "Qwen21 Scheduler (released / turbo SIGMAS)"},
    "latent": {"Qwen21EmptyLatent": "Qwen21 Empty Latent (KSampler)"},
    "vae": {"Qwen21VAEDecode": "Qwen21 VAE Decode (RGBA)", "Qwen21VAEEncode": "Qwen21 VAE Encode"},
    "save": {"Qwen21SaveImage": "Qwen21 Save Image (fast PNG)"},
}

# Modules that subclass ComfyUI's own classes (the MODEL, its patcher, the VAE): imported only inside ComfyUI.
COMFYUI_ONLY_MODULES = ("comfy.model", "comfy.patcher", "comfy.vae", "comfy.latents", "comfy.control")

NODE_CLASS_MAPPINGS: dict = {}
NODE_DISPLAY_NAME_MAPPINGS: dict = {}
UNAVAILABLE: dict[str, str] = {}  # class name -> why its module failed to import (the runner names the cause)

for _module_name, _classes in _NODES.items():
    try:
        _module = importlib.import_module(f".{_module_name}", __name__)
    except Exception as _error:  # noqa: BLE001 - one broken node module must not take the pack down
        log.exception("qwen21-nodes: failed to import nodes.%s; its nodes are unavailable", _module_name)
        UNAVAILABLE.update(dict.fromkeys(_classes, f"nodes.{_module_name} failed to import: "
                                                   f"{type(_error).__name__}: {_error}"))  # fmt: skip
        continue
    for _class_name, _display_name in _classes.items():
        _class = getattr(_module, _class_name)
        if isinstance(getattr(_class, "DESCRIPTION", None), str):  # a docstring's indentation is not the help's
            _class.DESCRIPTION = inspect.cleandoc(_class.DESCRIPTION)
        NODE_CLASS_MAPPINGS[_class_name] = _class
        NODE_DISPLAY_NAME_MAPPINGS[_class_name] = _display_name
