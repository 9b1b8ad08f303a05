"""Every theme file loads as a Textual Theme and the app renders in it."""

from pathlib import Path

import pytest

from kvtui import viewers
from kvtui.options import AppConfig
from kvtui.themes import ThemeFileError, load_theme, load_themes

FILES = sorted((Path(__file__).resolve().parents[2] / "themes").glob("*.toml"))


def test_the_required_themes_exist():
    assert {"kvtui-dark", "kvtui-light", "kvtui-high-contrast", "kvtui-projector"} <= set(load_themes())


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
async def test_theme_file_loads_and_renders(path: Path, tmp_path):
    theme = load_theme(path)
    assert theme.name == path.stem
    app = viewers.chat(AppConfig(model=str(tmp_path / "none"), theme=theme.name))
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause(0.1)
        assert app.theme == theme.name
        assert app.export_screenshot()  # renders every pane in it


def test_a_bad_theme_file_names_itself(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "bad"\nprimary = "not-a-colour"\n')
    with pytest.raises(ThemeFileError, match="bad.toml"):
        load_theme(bad)
    bad.write_text('name = "bad"\nprimary = "#fff"\nsparkle = 1\n')
    with pytest.raises(ThemeFileError, match="unknown keys"):
        load_theme(bad)
