"""qwen21-nodes: fast Qwen-Image-2.1 for ComfyUI.

ComfyUI imports this package from custom_nodes/<any folder name>/. Everything below is imported
relatively, and a failure to import the node classes is logged instead of raised, so a broken
optional dependency never takes the ComfyUI server (or the rest of the pack) down.
"""

import logging

log = logging.getLogger(__name__)

WEB_DIRECTORY = "./web"
NODE_CLASS_MAPPINGS: dict = {}
NODE_DISPLAY_NAME_MAPPINGS: dict = {}

try:
    from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: F811
except Exception:  # noqa: BLE001 - keep the host alive; the log says what failed
    log.exception("qwen21-nodes: the node classes failed to import; the pack is disabled")

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
