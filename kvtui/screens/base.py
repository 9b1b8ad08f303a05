"""What every screen of the app shares: one meaning for the chrome keys, and keys a source cannot honour.

- pause (`p`): pause what the screen follows (the model or program, the view of a server's events); a source
  that cannot pause says why.
- quit (`q`): stop what the screen follows (kvtui's own engines, a program kvtui started, the event reader),
  then the app. Never a server kvtui attached to: only the reader of its events stops.
- help (`?`, `F1`): the keys of this screen as they are bound now (app.py builds it from `active_bindings`),
  with this screen's notes on its source.
- theme (`t`), screenshot (`F12`): the app's.
"""

from __future__ import annotations

from typing import ClassVar

from textual import events
from textual.screen import Screen
from textual.widgets import Input


class SourceScreen(Screen):
    """A screen showing one source. Subclasses set BINDINGS (keys.py: the chrome keys and their own), CSS_PATH,
    and say what the chrome asks: `pause_source`, `stop_source`, `help_notes`, `unavailable`."""

    # actions this screen cannot do, with why (dimmed in the footer, listed in help, said when pressed)
    UNAVAILABLE: ClassVar[dict[str, str]] = {}
    HELP_TITLE: ClassVar[str] = "kvtui keys"

    # ---- what the chrome asks of a screen ----------------------------------------------------------------

    def pause_source(self) -> None:
        """p: pause what this screen follows, or resume it."""

    def stop_source(self) -> None:
        """End what this screen follows (blocking: the app calls it off the UI thread on quit, and again as the
        screen unmounts; a second call returns at once). Never a server kvtui only attached to."""

    def help_notes(self) -> str:
        """Help's text under the keys: how this screen reads, in its source's words."""
        return ""

    def unavailable(self, action: str) -> str | None:
        """Why `action` cannot run here (None: it can)."""
        return self.UNAVAILABLE.get(action)

    # ---- the chrome keys: the same on every screen --------------------------------------------------------

    def action_pause(self) -> None:
        self.pause_source()

    def action_help(self) -> None:
        self.app.show_help(self)  # type: ignore[attr-defined]  (KvtuiApp)

    def action_next_theme(self) -> None:
        self.app.next_theme()  # type: ignore[attr-defined]

    def action_screenshot(self) -> None:
        path = self.app.save_screenshot()
        self.notify(f"screenshot saved to {path}", timeout=6)

    async def action_quit(self) -> None:
        await self.app.action_quit()

    # ---- keys this screen's source cannot honour --------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        return None if self.unavailable(action) is not None else True  # None: shown disabled

    def on_key(self, event: events.Key) -> None:
        """Textual skips a disabled binding silently: a key pressed for one hears why instead."""
        if isinstance(self.focused, Input):  # typed text, not a key for the screen
            return
        for binding in self._bindings.key_to_bindings.get(event.key, ()):
            why = self.unavailable(binding.action.partition("(")[0])
            if why is not None:
                event.stop()
                self.notify(why, severity="warning", timeout=4)
                return

    def notify(self, message: str, *, title: str = "", severity="information", timeout=None, markup=False) -> None:
        """The app's notify (text shown literally): a screen's notices are never markup."""
        self.app.notify(message, title=title, severity=severity, timeout=timeout, markup=False)

    def on_unmount(self) -> None:
        self.stop_source()  # at once when it has ended already
