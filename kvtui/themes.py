"""Themes: TOML files in themes/ (and any user directory), turned into Textual `Theme` objects."""

from __future__ import annotations

import tomllib
from dataclasses import fields
from pathlib import Path

from textual.theme import Theme

THEMES_DIR = Path(__file__).resolve().parent.parent / "themes"
DEFAULT_THEME = "kvtui-dark"
_ALLOWED = {f.name for f in fields(Theme)}


class ThemeFileError(Exception):
    """A theme file that cannot be used: names the file and the problem."""


def load_theme(path: Path) -> Theme:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ThemeFileError(f"{path}: {exc}") from None
    unknown = set(data) - _ALLOWED
    if unknown:
        raise ThemeFileError(f"{path}: unknown keys {sorted(unknown)}")
    for required in ("name", "primary"):
        if not isinstance(data.get(required), str):
            raise ThemeFileError(f"{path}: '{required}' is required")
    try:
        theme = Theme(**data)
        theme.to_color_system()  # parses every colour: a typo fails here, not at run time
    except Exception as exc:
        raise ThemeFileError(f"{path}: {exc}") from None
    return theme


def load_themes(directory: Path = THEMES_DIR) -> dict[str, Theme]:
    themes = {}
    for path in sorted(directory.glob("*.toml")):
        theme = load_theme(path)
        themes[theme.name] = theme
    return themes
