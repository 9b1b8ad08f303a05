"""A modal to change the sampler (and the turn length) while the session runs."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Grid, Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static

from ...engine.chat.settings import SamplerSettings

FIELDS = (
    ("temperature", float, "0 = greedy"),
    ("top_k", int, "0 = off"),
    ("top_p", float, "1 = off"),
    ("repetition_penalty", float, "1 = off"),
    ("seed", int, "integer"),
)


class SamplerModal(ModalScreen[SamplerSettings | None]):
    BINDINGS = [("escape", "cancel", "cancel")]
    DEFAULT_CSS = """
    SamplerModal { align: center middle; }
    SamplerModal > Vertical { width: 64; height: auto; border: thick $primary; background: $surface; padding: 1 2; }
    SamplerModal Grid { grid-size: 2; grid-columns: 22 1fr; height: auto; grid-gutter: 0 1; }
    SamplerModal Label { padding: 1 0 0 0; }
    SamplerModal #sampler-error { color: $error; height: auto; }
    SamplerModal Horizontal { height: auto; align: right middle; }
    """

    def __init__(self, settings: SamplerSettings):
        super().__init__()
        self.settings = settings

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static("[b]sampler[/b] (applies from the next token)")
            with Grid():
                for name, _, hint in FIELDS:
                    yield Label(name.replace("_", " "))
                    yield Input(str(getattr(self.settings, name)), placeholder=hint, id=f"field-{name}")
            yield Static("", id="sampler-error")
            with Horizontal():
                yield Button("apply", variant="primary", id="apply")
                yield Button("cancel", id="cancel")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "apply":
            self._apply()
        else:
            self.dismiss(None)

    def on_input_submitted(self) -> None:
        self._apply()

    def action_cancel(self) -> None:
        self.dismiss(None)

    def _apply(self) -> None:
        values = {}
        try:
            for name, kind, _ in FIELDS:
                raw = self.query_one(f"#field-{name}", Input).value.strip()
                values[name] = kind(raw)
            settings = SamplerSettings(**values)
        except ValueError as exc:
            self.query_one("#sampler-error", Static).update(f"not applied: {exc}")
            return
        self.dismiss(settings)
