"""The attach screen's notes: what the prefix cache raised (recomputed-prefix, template-drift, varying-start,
cache-churn), newest last, the newest MAX_SHOWN kept. Enter on a note selects the block (or chain) it names
in the tree (the app does it: CacheNotes.Chosen)."""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual.message import Message
from textual.widgets import OptionList

from ...engine.records.snapshot import Diagnostic
from ..shared.palette import Palette, role_style

MAX_SHOWN = 200
REMOVE_ONE_BY_ONE = 20  # more old notes than this to drop at once: the list is rebuilt instead


def note_text(note: Diagnostic, palette: Palette | None = None) -> Text:
    text = Text()
    text.append(f"{note.severity} ", style=role_style(palette, note.severity, "bold"))
    text.append(f"{note.code}", style="bold")
    text.append(f": {note.message}")
    text.append(f" (batch {note.step})", style=role_style(palette, "muted"))  # last: the message's facts first
    return text


class CacheNotes(OptionList):
    DEFAULT_CSS = """
    CacheNotes {
        border: round $foreground 25%;
        border-title-color: $text-muted;
        &:focus { border: round $accent; }
    }
    """

    @dataclass
    class Chosen(Message):
        note: Diagnostic

    def __init__(self, *, id: str | None = None):
        super().__init__(id=id)
        self.notes: list[Diagnostic] = []
        self.total = 0
        self.border_title = "notes"

    def add_notes(self, notes: list[Diagnostic], total: int, palette: Palette | None = None) -> None:
        """Append the new notes (`total`: how many the cache raised in all)."""
        self.total = total
        if notes:
            follow = self.highlighted is None or self.highlighted >= len(self.notes) - 1
            extra = len(self.notes) + len(notes) - MAX_SHOWN
            if extra > REMOVE_ONE_BY_ONE:  # a burst: start again from the newest (O(MAX_SHOWN))
                self.notes = (self.notes + list(notes))[-MAX_SHOWN:]
                self.clear_options()
                self.add_options([note_text(note, palette) for note in self.notes])
            else:
                self.notes.extend(notes)
                self.add_options([note_text(note, palette) for note in notes])
                if extra > 0:
                    del self.notes[:extra]
                    for _ in range(extra):
                        self.remove_option_at_index(0)
            if follow:
                self.scroll_end(animate=False)
        older = total - len(self.notes)
        self.border_title = f"notes · {total}" + (f" (the newest {len(self.notes)} here)" if older > 0 else "")

    def note_at(self, index: int | None) -> Diagnostic | None:
        if index is None or not 0 <= index < len(self.notes):
            return None
        return self.notes[index]

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        note = self.note_at(event.option_index)
        if note is not None:
            self.post_message(self.Chosen(note))
