"""`kvtui themes`: the shipped themes and the user's, with their files."""

from __future__ import annotations

from pathlib import Path

import click

from ..options import DEFAULT_THEME
from . import check_theme as _check_theme


@click.command("themes")
def themes():
    """List the themes: the shipped ones and yours (*.toml in the user themes dir)."""
    from ..locations import user_themes_dir

    _check_theme(DEFAULT_THEME)
    from ..themes import theme_files

    for path in theme_files():
        click.echo(f"{Path(path.name).stem:24} {path}")
    click.echo(f"\nyour themes: {user_themes_dir()}/*.toml (Textual Theme fields; same name replaces a shipped one)")
