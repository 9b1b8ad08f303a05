"""The one Textual app of every front end. What it shows is the screen it is given (kvtui/screens): the step
viewer (kvtui's own chat, a trace, a watched program or process tree), the server view (a server's prefix
cache, live or from its trace) or compare. The commands (kvtui/viewers.py) build the source and its screen; the
app names no source. The chrome is here, once: the themes, the notices, the help screen, theme cycling, and quit.
"""

from __future__ import annotations

import asyncio

from textual.app import App

from .fmt import printable
from .keys import QUIT
from .screens.base import SourceScreen
from .themes import register_themes
from .widgets.shared.help_screen import HelpScreen

__all__ = ["KvtuiApp"]


class KvtuiApp(App):
    TITLE = "kvtui"
    BINDINGS = [QUIT]  # replaces Textual's ctrl+q: q quits from every screen, and says so in the footer
    DEFAULT_MODE = "view"  # the one mode: its base screen is the view given (a mode loads the screen's CSS_PATH)

    def __init__(self, view: SourceScreen, *, theme: str | None = None):
        """`view`: the screen showing the source (kept under every other screen); `theme`: a theme's name (the
        options checked it; one gone since falls back to the default)."""
        super().__init__()
        self.view = view
        self.add_mode(self.DEFAULT_MODE, lambda: view)
        self._themes = register_themes(self, theme)

    def notify(
        self,
        message: str,
        *,
        title: str = "",
        severity="information",
        timeout: float | None = None,
        markup: bool = False,
    ) -> None:
        """Every notification shows its text literally: no markup, control characters escaped."""
        super().notify(
            printable(message, newlines=True), title=printable(title), severity=severity, timeout=timeout, markup=False
        )

    def show_help(self, screen: SourceScreen) -> None:
        """The help screen: `screen`'s keys as bound now (its active bindings), then its notes."""
        self.push_screen(HelpScreen(screen))

    def next_theme(self) -> None:
        names = sorted(self._themes)
        self.theme = names[(names.index(self.theme) + 1) % len(names)] if self.theme in names else names[0]
        self.notify(f"theme: {self.theme}", timeout=2)

    async def action_quit(self) -> None:
        """Quit at any moment: what the screen follows ends first (off the UI thread: an engine finishes its
        forward and closes its trace), then the app."""
        await asyncio.to_thread(self.view.stop_source)
        self.workers.cancel_node(self.view)
        self.exit()
