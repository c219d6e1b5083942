"""One stable name for every exception class a user can see.

ComfyUI imports a custom-node pack under a module name made from its folder path
("/home/me/ComfyUI/custom_nodes/qwen21-nodes"), and reports a failed node's `exception_type` as the
class's module + name, so our errors would read "/home/me/.../qwen21-nodes.qwen21_core.encoding.X".
`stable_name` renames a class's module to the pip package's name for it ("qwen21_nodes.qwen21_core.
encoding.X"), which is the same however and wherever the pack was imported.
"""

from __future__ import annotations

PACKAGE = "qwen21_nodes"
# The name the host imported the pack under: this module's name without its place in the pack.
_IMPORTED_AS = __name__.removesuffix(".qwen21_core.errors")


def stable_name(cls: type) -> type:
    """Class decorator: report `cls` under the package name `qwen21_nodes`, not the host's import name."""
    if cls.__module__.startswith(_IMPORTED_AS + "."):
        cls.__module__ = PACKAGE + cls.__module__[len(_IMPORTED_AS) :]
    return cls
