"""ComfyUI's own nodes that the KSampler example workflows use, declared (inputs and outputs as ComfyUI 0.3.64 declares
them) but not runnable outside ComfyUI: their work is ComfyUI's sampling, LoRA patching and VAE code.

The runner uses the declarations to check such a workflow and to refuse it up front with a message that says to run
it in ComfyUI; workflows/build.py uses them to write the workflows' UI format. Only the choices our workflows and
help pages name are listed for the sampler and scheduler (ComfyUI has more).
"""

from __future__ import annotations

SAMPLERS = ["euler", "euler_ancestral", "dpmpp_2m", "res_multistep"]
SCHEDULERS = ["simple", "normal", "beta"]
WHY = ("is ComfyUI's own node: the command line runs the pack's nodes and its stand-ins for loading and saving "
       "images only. Run this workflow in ComfyUI: drag its UI file (workflows/*.json) onto the canvas, or POST its "
       "API file to a ComfyUI server.")  # fmt: skip


class _ComfyUIOnly:
    COMFYUI_ONLY = WHY  # why the runner refuses it (runner/graph.py validate)

    def run(self, **_inputs):
        raise RuntimeError(f"{type(self).__name__} {WHY}")


class KSampler(_ComfyUIOnly):
    CATEGORY = "sampling"
    RETURN_TYPES = ("LATENT",)
    FUNCTION = "run"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": ("MODEL", {}),
                "seed": ("INT", {"default": 0, "min": 0, "max": 0xFFFFFFFFFFFFFFFF, "control_after_generate": True}),
                "steps": ("INT", {"default": 20, "min": 1, "max": 10000}),
                "cfg": ("FLOAT", {"default": 8.0, "min": 0.0, "max": 100.0, "step": 0.1, "round": 0.01}),
                "sampler_name": (SAMPLERS, {}),
                "scheduler": (SCHEDULERS, {}),
                "positive": ("CONDITIONING", {}),
                "negative": ("CONDITIONING", {}),
                "latent_image": ("LATENT", {}),
                "denoise": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 1.0, "step": 0.01}),
            }
        }


class LoraLoaderModelOnly(_ComfyUIOnly):
    CATEGORY = "loaders"
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "run"

    @classmethod
    def INPUT_TYPES(cls):
        from ..nodes import host

        return {
            "required": {
                "model": ("MODEL", {}),
                "lora_name": (host.list_weight_files("loras"), {}),
                "strength_model": ("FLOAT", {"default": 1.0, "min": -100.0, "max": 100.0, "step": 0.01}),
            }
        }


class VAEDecode(_ComfyUIOnly):
    CATEGORY = "latent"
    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "run"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"samples": ("LATENT", {}), "vae": ("VAE", {})}}


NODES = {node.__name__: node for node in (KSampler, LoraLoaderModelOnly, VAEDecode)}
