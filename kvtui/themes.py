"""Themes: TOML files shipped in the package and in the user's config dir, turned into Textual `Theme`s.

Shipped themes come first; a user theme with the same name replaces the shipped one.
"""

from __future__ import annotations

import tomllib
from dataclasses import fields
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import TYPE_CHECKING

from textual.theme import Theme

from .locations import DEFAULT_THEME, shipped, user_themes_dir

if TYPE_CHECKING:
    from textual.app import App

__all__ = [
    "DEFAULT_THEME",
    "ThemeFileError",
    "load_theme",
    "load_themes",
    "register_themes",
    "theme_error",
    "theme_files",
]
_ALLOWED = {f.name for f in fields(Theme)}


class ThemeFileError(Exception):
    """A theme file that cannot be used: names the file and the problem."""


def load_theme(path: Path | Traversable) -> Theme:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
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
    except Exception as exc:  # noqa: BLE001  Theme() raises whatever a bad value makes it raise: said as one line
        raise ThemeFileError(f"{path}: {' '.join(str(exc).split())}") from None
    return theme


def theme_files(user_dir: Path | None = None) -> list[Path | Traversable]:
    """The shipped theme files, then the user's (``~/.config/kvtui/themes/*.toml``)."""
    shipped_files = sorted((f for f in shipped("themes").iterdir() if f.name.endswith(".toml")), key=lambda f: f.name)
    user_dir = user_themes_dir() if user_dir is None else user_dir
    user_files = sorted(user_dir.glob("*.toml")) if user_dir.is_dir() else []
    return [*shipped_files, *user_files]


def load_themes(user_dir: Path | None = None) -> dict[str, Theme]:
    """Every theme by name; a broken file raises ThemeFileError naming it."""
    themes = {}
    for path in theme_files(user_dir):
        theme = load_theme(path)
        themes[theme.name] = theme
    return themes


def register_themes(app: App, name: str | None) -> dict[str, Theme]:
    """The one place themes reach the app: every theme registered, `name` made current (one that is not
    there, as a theme file removed since the options were checked: the default). Returns them by name."""
    themes = load_themes()
    for theme in themes.values():
        app.register_theme(theme)
    name = name or DEFAULT_THEME
    app.theme = name if name in themes or name in app.available_themes else DEFAULT_THEME
    return themes


def theme_error(theme: str) -> str | None:
    """Why `theme` cannot be used (a broken theme file, or no such name), or None: checked before any screen."""
    try:
        names = set(load_themes())
    except ThemeFileError as exc:
        return f"theme file {exc}"
    if theme not in names and theme not in ("textual-dark", "textual-light"):
        return f"no theme named {theme!r}; available: {', '.join(sorted(names))}"
    return None
