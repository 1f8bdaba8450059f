"""autoshard's version, read once: the installed distribution's, or in a source checkout that
is not installed, the one its pyproject.toml declares. What writes a checkpoint or an export
records it (``VERSION``)."""

from __future__ import annotations

import os
import re

# the checkout's root, where pyproject.toml is (the folder above the package)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def read_version(root: str = ROOT) -> str:
    """The distribution's version, else ``root``'s pyproject.toml's, else "unknown"."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("autoshard")
    except PackageNotFoundError:
        pass
    try:
        with open(os.path.join(root, "pyproject.toml")) as fh:
            text = fh.read()
    except OSError:
        return "unknown"
    project = re.search(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    found = project and re.search(r'^version\s*=\s*"([^"]+)"', project.group(1), re.M)
    return found.group(1) if found else "unknown"


VERSION = read_version()
