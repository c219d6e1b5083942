"""Names of files inside a folder (a model file inside a ComfyUI model folder, a shard inside its index's folder)
that must stay inside it.

The rule is lexical: a name is a relative path whose parts are never `..`, with no root, drive or NUL, so joined to
its folder it names something in that folder. Where that entry leads is not checked: a symlink the user placed
inside a model folder (weights kept on another disk) is a normal setup, and a download cannot place one. Names use
`/` or, as ComfyUI lists them on Windows, `\\`; both are read as separators on every system.
"""

from __future__ import annotations

import ntpath
import os


def relative_name(name, what: str) -> str:
    """`name` if it is a relative path inside its folder, else ValueError naming `what` (e.g. "loras name")."""
    if not isinstance(name, str):
        raise ValueError(f"{what} must be a relative path inside its folder, got a {type(name).__name__}")
    parts = name.replace("\\", "/").split("/")
    if (
        not name
        or "\x00" in name
        or name.startswith(("/", "\\"))
        or ntpath.splitdrive(name)[0]
        or ".." in parts
        or not any(part not in ("", ".") for part in parts)
    ):
        raise ValueError(f"{what} {name!r:.200} must be a relative path inside its folder (no root, drive or '..')")
    return name


def join_inside(folder: str | os.PathLike, name: str, what: str) -> str:
    """folder/name, for a `name` that `relative_name` accepts (checked here again)."""
    folder = os.path.abspath(os.fspath(folder))
    path = os.path.normpath(os.path.join(folder, *relative_name(name, what).replace("\\", "/").split("/")))
    if os.path.commonpath([folder, path]) != folder:  # cannot happen after relative_name; kept as the invariant
        raise ValueError(f"{what} {name!r:.200} must be a relative path inside its folder {folder}")
    return path
