"""The chat pane: the transcript with roles, the reply streaming token by token, and the input box."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Input

from ...engine.records.token_bytes import ending_on
from ...fmt import printable
from ..shared.live_text import LiveText

ROLE_STYLE = {"system": "chat--system", "user": "chat--user", "assistant": "chat--assistant"}


def program_step_text(snapshot, row: int = 0, recomputed: int = 0) -> str:
    """The reuse meter of a watched program's step (live or recorded): where its forward came from, the cache
    it used and how far that cache went, what the program asked for, and for a prefill what it reused.
    `recomputed`: prefill tokens re-encoded so far that another cache of the same model held."""
    rows = f" · row {row + 1}/{snapshot.batch} (n: next)" if snapshot.batch > 1 else ""
    asked = ""
    if snapshot.requested_cache_position:
        asked = f" · asked cache_position {snapshot.requested_cache_position[0]}.."
    elif snapshot.requested_positions:
        asked = f" · asked position_ids {snapshot.requested_positions[0]}.."
    # the program's own names (its file, thread, model, cache) escaped here: the line breaks are kvtui's
    who = f" · {printable(snapshot.model)}" if snapshot.model else ""
    thread = (
        f" · {printable(snapshot.thread)}" if snapshot.thread and snapshot.thread not in (snapshot.caller or "") else ""
    )
    lineage = printable(snapshot.lineage) if snapshot.lineage else "no cache"
    text = (
        f"step {snapshot.step} at {printable(snapshot.caller)}{thread}{who} · {lineage} "
        f"{snapshot.cache_length_before}→{snapshot.cache_seq_length}{asked}{rows}"
    )
    if snapshot.phase == "prefill" and snapshot.cache_length_before is not None:
        fed, held = len(snapshot.input_ids), snapshot.cache_seq_length
        share = (held - fed) / held if held else 0.0
        text += (
            f"\nturn {snapshot.turn} of this cache · reused {held - fed} cached tokens, fed {fed} ({share:.0%} reuse)"
        )
    if recomputed:
        text += f" · re-encoded {recomputed} tokens other caches held (recomputed-prefix)"
    return text


class ChatPane(Vertical):
    """Shows `messages` (role, content dicts) and owns the input; the app handles Input.Submitted."""

    DEFAULT_CSS = """
    ChatPane { border: round $panel; border-title-color: $text-muted; }
    ChatPane > VerticalScroll { height: 1fr; }
    ChatPane .message { margin: 0 0 1 0; }
    ChatPane .chat--user { color: $primary; }
    ChatPane .chat--assistant { color: $foreground; }
    ChatPane .chat--system { color: $text-muted; }
    ChatPane #reuse { color: $text-muted; height: auto; }
    ChatPane Input { dock: bottom; }
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.border_title = "chat"
        self._shown: list[tuple[str, str]] = []
        # the message widgets, in order: kept here, since the transcript's children lag a removal or mount (both
        # complete later), and a repaint can come first
        self._widgets: list[LiveText] = []

    def compose(self) -> ComposeResult:
        yield VerticalScroll(id="transcript")
        yield LiveText("", id="reuse")
        yield Input(placeholder="Enter or i: type a message (Enter sends it)", id="message")

    @property
    def input(self) -> Input:
        return self.query_one("#message", Input)

    def show_messages(self, messages: list[dict], pending: str | None = None, unfinished: bytes = b"") -> None:
        """Update only what changed: new messages are mounted, the streaming reply is re-rendered. `unfinished`:
        the bytes the cache ends on that begin a character not complete yet (`unfinished_tail`); the last message,
        which ends there, shows them as bytes (`⟨f0 9f⟩`), as the token buffer does, not as the U+FFFD a decoder
        gives them."""
        transcript = self.query_one("#transcript", VerticalScroll)
        rows = [(m["role"], m["content"]) for m in messages]
        if unfinished and rows:
            rows[-1] = (rows[-1][0], ending_on(rows[-1][1], unfinished))
        if pending and rows and rows[-1][0] == "assistant":
            rows[-1] = ("assistant", rows[-1][1] + pending)
        widgets = self._widgets
        if len(rows) < len(widgets) or any(
            self._shown[i][0] != rows[i][0] for i in range(min(len(rows), len(self._shown)))
        ):
            transcript.remove_children()
            widgets, self._shown = [], []
            self._widgets = widgets
        grew = False  # follow the end only when the transcript's height changed (a reply that wrapped, a new message)
        for index, (role, content) in enumerate(rows):
            if index < len(widgets):
                if self._shown[index] != (role, content):
                    text = self._message_text(role, content, streaming=index == len(rows) - 1 and bool(pending))
                    grew = widgets[index].show_text(text) or grew
            else:
                widget = LiveText(self._message_text(role, content), classes=f"message {ROLE_STYLE.get(role, '')}")
                widgets.append(widget)
                transcript.mount(widget)
                grew = True
        self._shown = rows
        if grew:
            transcript.scroll_end(animate=False)

    def show_reuse(self, text: str) -> None:
        """kvtui's own line (a source's names in it escaped by whoever wrote it): its line breaks are kept."""
        self.query_one("#reuse", LiveText).show_text(Text(printable(text, newlines=True)))

    @staticmethod
    def _message_text(role: str, content: str, streaming: bool = False) -> Text:
        text = Text()
        text.append(f"{role}: ", style="bold")
        # control characters and bidi overrides from the user or the model are shown, never interpreted
        text.append(printable(content, newlines=True) or ("…" if role == "assistant" else ""))
        if streaming:
            text.append("▌", style="blink")
        return text
