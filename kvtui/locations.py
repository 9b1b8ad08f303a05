"""Where kvtui's files are: the themes and samples shipped inside the package (importlib.resources, so
they are found in a wheel as in a checkout) and the user's own themes in the platform config dir.

In the source tree `kvtui/data/themes` and `kvtui/data/samples` are links to the top-level `themes/`
and `samples/`; building the wheel copies their files into the package (pyproject's package-data).
"""

from __future__ import annotations

import os
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path

import platformdirs

CONFIG_ENV = "KVTUI_CONFIG_DIR"
DEFAULT_THEME = "kvtui-dark"  # a shipped theme (themes/kvtui-dark.toml)


def shipped(kind: str) -> Traversable:
    """The shipped `themes` or `samples` folder, wherever the package is installed."""
    return files("kvtui").joinpath("data", kind)


def config_dir() -> Path:
    """``$KVTUI_CONFIG_DIR`` if set, else the platform user config dir (``~/.config/kvtui`` on Linux)."""
    env = os.environ.get(CONFIG_ENV)
    return Path(env).expanduser() if env else Path(platformdirs.user_config_dir("kvtui"))


def user_themes_dir() -> Path:
    return config_dir() / "themes"
