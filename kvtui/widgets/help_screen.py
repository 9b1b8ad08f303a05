"""The help screen: every key, generated from the app's bindings so it cannot drift from them."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

NOTES = """
Send a message with Enter in the input box (i focuses it, Esc leaves it). By default the reply runs to
the end of the turn; in step mode (m) only the prompt is prefilled and you step with space.
Select a token in the buffer (arrows, click) and press backspace to rewind the cache to it.
Select a row in top-k and press f to force that token instead of the sampled one.
Special tokens show whole in the cache pane (its cells widen for them, up to 32 cells); the selected
token's whole piece, id, position and origin show in the cursor pane.
Shapes: `K=V 3×125×64` is kv_heads×tokens×head_dim with batch 1 left out when K and V are alike;
`K 1×12×16 V 1×12×8` when they differ; `b2` marks a batch of 2.
Short terminals fold the layers and diagnostics panes (F5 / F6 show them; the alarm line shows the top
alarm meanwhile); they unfold when the terminal grows. In diagnostics, x expands an alarm group.
A watched server or generate_batch (continuous batching) lists its requests above the cache pane: n picks
the next request (or arrows / click in the list, F7 hides it); the cache, cursor and top-k panes show the
picked request, and the cursor pane says when this forward did not feed it. The layers pane shows the paged
cache's blocks per group: used (shared), cached for reuse, free.
--attention (opt-in) costs O(cache) per step: it reads the newest query's attention over every position.
"""


class HelpScreen(ModalScreen):
    BINDINGS = [Binding("escape,q,question_mark,f1", "app.pop_screen", "close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll {
        width: 90; max-width: 95%; height: 80%; border: thick $primary; background: $surface; padding: 1 2;
    }
    """

    def __init__(self, bindings: list[Binding], unavailable=lambda action: None):
        """`unavailable(action)`: why the app's source cannot do an action (None: it can)."""
        super().__init__()
        self._key_bindings = bindings
        self._unavailable = unavailable

    def compose(self) -> ComposeResult:
        table = Table(title="kvtui keys", expand=True, show_edge=False)
        table.add_column("key", style="bold", no_wrap=True)
        table.add_column("does")
        for binding in self._key_bindings:
            keys = ", ".join(k.strip() for k in binding.key.split(","))
            why = self._unavailable(binding.action.partition("(")[0])
            table.add_row(
                keys,
                binding.description if why is None else Text(f"{binding.description}: not here ({why})", style="dim"),
            )
        with VerticalScroll():
            yield Static(table)
            yield Static(NOTES.strip())
