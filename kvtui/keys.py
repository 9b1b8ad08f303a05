"""The app's keys, one table: what each does and whether the footer shows it (the help screen reads it too).

A source's own keys (`b`, `n`, `M` for a watched program) are bound by its driver on that app instance only."""

from __future__ import annotations

from textual.binding import Binding

APP_KEYS = [
    Binding("f5", "toggle_pane('layers')", "layers", tooltip="show/hide the layers pane (folded on short terminals)"),
    Binding(
        "f6",
        "toggle_pane('diagnostics')",
        "alarms",
        tooltip="show/hide the diagnostics pane (folded on short terminals: the alarm line shows the top alarm)",
    ),
    Binding("space,s", "step", "step"),
    Binding("r", "run", "run"),
    Binding("p", "pause", "pause"),
    Binding("escape", "stop", "stop turn", show=False),
    Binding("u", "rewind", "rewind 1"),
    Binding("backspace", "rewind_to", "rewind to selected", show=False),
    Binding("f", "force", "force selected top-k", show=False),
    Binding("v", "verify", "verify"),
    Binding("w", "watch", "watch the selected top-k token", show=False),
    Binding("m", "toggle_step_mode", "step mode"),
    Binding("o", "sampler", "sampler"),
    Binding("i", "focus_input", "type", show=False),
    Binding("enter", "next_script_turn", "send the script's next turn", show=False),
    Binding("g", "live", "back to live step", show=False),
    Binding("X", "reset", "reset cache and chat", show=False),
    Binding("R", "restart_engine", "restart a stopped engine (replays the chat)", show=False),
    Binding("ctrl+s", "save_trace", "save trace"),
    Binding("e", "export_cache", "export the cache (safetensors)", show=False),
    Binding("f12", "screenshot", "screenshot (SVG)", show=False),
    Binding("t", "next_theme", "theme", show=False),
    Binding("f2", "toggle_pane('buffer')", "show/hide token buffer", show=False),
    Binding("f3", "toggle_pane('cursor')", "show/hide cursor", show=False),
    Binding("f4", "toggle_pane('topk')", "show/hide top-k", show=False),
    Binding("f7", "toggle_pane('requests')", "show/hide the requests (a continuous-batching forward)", show=False),
    Binding("right_square_bracket", "attention_layer(1)", "attention: next layer (--attention)", show=False),
    Binding("left_square_bracket", "attention_layer(-1)", "attention: previous layer / all layers", show=False),
    Binding("right_curly_bracket", "attention_head(1)", "attention: next head of the layer", show=False),
    Binding("left_curly_bracket", "attention_head(-1)", "attention: previous head / head mean", show=False),
    Binding("question_mark,f1", "help", "help"),
    Binding("q,ctrl+q", "quit", "quit", priority=False),
]
