"""The help screen, one class for every screen: the keys of the screen under it as they are bound now (its
`active_bindings`: the screen's, its source's, the focused pane's), keys written as people write them (`?`,
`F1`), a key the source cannot honour dimmed with the reason, then that screen's notes on its source (Markdown)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Markdown, Static

from ...keys import key_label

if TYPE_CHECKING:
    from textual.screen import Screen


def kvtui_action(node, action: str) -> bool:
    """Whether `action` (bound on `node`) is one of kvtui's: Textual's own (focus next, copy, the command
    palette) are not listed, so help shows the keys kvtui gives and says what each does in kvtui's words."""
    name = action.partition("(")[0]
    target = node
    if "." in name:
        namespace, name = name.split(".", 1)
        target = node.app if namespace == "app" else node.screen if namespace == "screen" else node
    method = getattr(type(target), f"action_{name}", None)
    return method is not None and method.__module__.startswith("kvtui.")


def help_rows(screen: Screen) -> tuple[list[tuple[str, Binding]], list[tuple[str, Binding]]]:
    """(the screen's keys and the app's, the focused pane's keys) as (keys, binding), one row per action: the
    keys of one action joined (`?, F1`), only kvtui's actions (see kvtui_action)."""
    rows: dict[tuple[bool, str, str], list[str]] = {}
    bindings: dict[tuple[bool, str, str], Binding] = {}
    for key, active in screen.active_bindings.items():
        node, binding = active.node, active.binding
        if not kvtui_action(node, binding.action):
            continue
        own = node is screen or node is screen.app
        ident = (own, binding.action, binding.description)
        rows.setdefault(ident, []).append(key_label(key))
        bindings.setdefault(ident, binding)
    screen_rows = [(", ".join(keys), bindings[ident]) for ident, keys in rows.items() if ident[0]]
    pane_rows = [(", ".join(keys), bindings[ident]) for ident, keys in rows.items() if not ident[0]]
    return screen_rows, pane_rows


class HelpScreen(ModalScreen):
    BINDINGS = [Binding("escape,q,question_mark,f1", "app.pop_screen", "close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll {
        width: 90; max-width: 95%; height: 80%; border: thick $primary; background: $surface; padding: 1 2;
    }
    """

    def __init__(self, screen: Screen):
        """`screen`: the screen whose keys to list (a SourceScreen: its `unavailable(action)` says why a key is
        dimmed, its `help_notes()` what follows the keys)."""
        super().__init__()
        self._screen = screen

    def compose(self) -> ComposeResult:
        screen = self._screen
        unavailable = getattr(screen, "unavailable", lambda action: None)
        own, pane = help_rows(screen)
        table = Table(title=getattr(screen, "HELP_TITLE", "kvtui keys"), expand=True, show_edge=False)
        table.add_column("key", style="bold", no_wrap=True)
        table.add_column("does")
        for keys, binding in own:
            why = unavailable(binding.action.partition("(")[0])
            table.add_row(
                keys,
                binding.description if why is None else Text(f"{binding.description}: not here ({why})", style="dim"),
            )
        if pane:
            table.add_section()
            for keys, binding in pane:
                table.add_row(keys, Text(f"{binding.description} (in the focused pane)"))
        notes = getattr(screen, "help_notes", lambda: "")()
        with VerticalScroll():
            yield Static(table)
            if notes:  # kvtui's own prose, written as Markdown (`K=V 3×125×64` is code): rendered, not raw
                yield Markdown(notes.strip())
