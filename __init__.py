"""qwen21-nodes: fast Qwen-Image-2.1 for ComfyUI.

ComfyUI imports this package from custom_nodes/<any folder name>/ and reads NODE_CLASS_MAPPINGS,
NODE_DISPLAY_NAME_MAPPINGS and WEB_DIRECTORY. The node classes are imported on first access (PEP 562),
so `import qwen21_nodes.qwen21_core...` in scripts and tests does not pay for the node layer. A failure
to import them is logged, not raised: a broken optional dependency never takes the ComfyUI server (or
the rest of the pack) down.
"""

import logging

log = logging.getLogger(__name__)

WEB_DIRECTORY = "./web"
_NODE_EXPORTS = ("NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS")


def __getattr__(name):
    if name not in _NODE_EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        from . import nodes

        mappings = {name: getattr(nodes, name) for name in _NODE_EXPORTS}
    except Exception:  # noqa: BLE001 - keep the host alive; the log says what failed
        log.exception("qwen21-nodes: the node classes failed to import; the pack is disabled")
        mappings = {name: {} for name in _NODE_EXPORTS}
    globals().update(mappings)
    return mappings[name]


__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
