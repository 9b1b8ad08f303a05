"""Theme colours for Rich cells: DataTable cells cannot use CSS variables, so the panes resolve
`$error`, `$warning`... from the running app's theme into plain Rich style strings, and re-render
when the theme changes."""

from __future__ import annotations

from collections.abc import Mapping

from rich.color import Color, ColorParseError
from textual.app import App
from textual.widget import Widget

Palette = Mapping[str, str]

# Rich style strings per role; the hex values are Textual's default dark theme.
DEFAULT_PALETTE: dict[str, str] = {
    "primary": "#0178D4",
    "accent": "#FEA62B",
    "success": "#4EBF71",
    "warning": "#FEA62B",
    "error": "#B93C5B",
    "info": "#0178D4",
    "muted": "dim",
}

_ROLE_VARIABLES = {  # palette role -> Textual theme variable
    "primary": "primary",
    "accent": "accent",
    "success": "success",
    "warning": "warning",
    "error": "error",
    # Textual's default accent is the same orange as its warning, so "info" follows $primary
    # (blue / cyan-ish in the kvtui themes) to stay distinguishable from warnings.
    "info": "primary",
}


def theme_palette(app: App | None) -> dict[str, str]:
    """Resolve the palette roles from the app's current theme; fall back to DEFAULT_PALETTE."""
    palette = dict(DEFAULT_PALETTE)
    if app is None:
        return palette
    try:
        variables = app.theme_variables or app.get_css_variables()
    except Exception:  # noqa: BLE001  no theme yet (app not running): keep the defaults
        return palette
    for role, name in _ROLE_VARIABLES.items():
        value = variables.get(name)
        if not value:
            continue
        try:
            Color.parse(value)
        except ColorParseError:  # e.g. "auto 60%": not a Rich colour
            continue
        palette[role] = value
    return palette


def role_style(palette: Palette | None, role: str, extra: str = "") -> str:
    """A Rich style string for a palette role, e.g. role_style(p, "error", "bold") -> "bold #B93C5B"."""
    style = (palette or DEFAULT_PALETTE).get(role) or DEFAULT_PALETTE.get(role, "")
    return f"{extra} {style}".strip()


class ThemedPane(Widget):
    """A pane whose Rich cells take the running theme's colours: `self._palette` follows the app's theme, and
    `repaint_theme()` redraws whenever it changes. Call `follow_theme()` from `on_mount`."""

    _palette: Palette = DEFAULT_PALETTE  # the default theme's until mounted

    def follow_theme(self) -> None:
        self._palette = theme_palette(self.app)
        self.app.theme_changed_signal.subscribe(self, self._theme_changed)

    def _theme_changed(self, _theme) -> None:
        self._palette = theme_palette(self.app)
        self.repaint_theme()

    def repaint_theme(self) -> None:
        self.refresh()
