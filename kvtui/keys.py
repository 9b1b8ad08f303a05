"""The keys, one module: the chrome every screen has (one meaning each: screens/base.py does them), the step
viewer's table (`APP_KEYS`), the server view's and compare's; how a key is written for people (help, README).

A source's own keys (`b`, `n`, `M` for a watched program) are bound by its driver on that screen instance only."""

from __future__ import annotations

import re

from textual.binding import Binding

# the chrome: every screen binds these, and they mean the same on each (screens/base.py SourceScreen)
PAUSE = Binding("p", "pause", "pause")
HELP = Binding("question_mark,f1", "help", "help")
THEME = Binding("t", "next_theme", "theme", show=False)
SCREENSHOT = Binding("f12", "screenshot", "screenshot (SVG)", show=False)
# first in every screen's table (the footer lists it first); the app binds it too, in place of Textual's ctrl+q
QUIT = Binding("ctrl+q,q", "quit", "quit", priority=False)  # ctrl+q first: the footer shows ^q, as before

# the step viewer (kvtui's own chat, a trace, a watched program or process tree)
APP_KEYS = [
    QUIT,
    Binding("f5", "toggle_pane('layers')", "layers", tooltip="show/hide the layers pane (folded on short terminals)"),
    Binding(
        "f6",
        "toggle_pane('diagnostics')",
        "alarms",
        tooltip="show/hide the diagnostics pane (folded on short terminals: the alarm line shows the top alarm)",
    ),
    Binding("space,s", "step", "step"),
    Binding("r", "run", "run"),
    PAUSE,
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
    SCREENSHOT,
    THEME,
    Binding("f2", "toggle_pane('buffer')", "show/hide token buffer", show=False),
    Binding("f3", "toggle_pane('cursor')", "show/hide cursor", show=False),
    Binding("f4", "toggle_pane('topk')", "show/hide top-k", show=False),
    Binding("f7", "toggle_pane('requests')", "show/hide the requests (a continuous-batching forward)", show=False),
    Binding("right_square_bracket", "attention_layer(1)", "attention: next layer (--attention)", show=False),
    Binding("left_square_bracket", "attention_layer(-1)", "attention: previous layer / all layers", show=False),
    Binding("right_curly_bracket", "attention_head(1)", "attention: next head of the layer", show=False),
    Binding("left_curly_bracket", "attention_head(-1)", "attention: previous head / head mean", show=False),
    HELP,
]

# the server view (kvtui attach, kvtui replay of a server trace)
SERVER_KEYS = [QUIT, Binding("n", "next_note", "next note"), PAUSE, HELP, THEME, SCREENSHOT]

# kvtui compare
COMPARE_KEYS = [QUIT, PAUSE, HELP, THEME, SCREENSHOT]

_NAMES = {
    "question_mark": "?",
    "escape": "Esc",
    "enter": "Enter",
    "backspace": "Backspace",
    "pageup": "PgUp",
    "pagedown": "PgDn",
    "home": "Home",
    "end": "End",
    "left_square_bracket": "[",
    "right_square_bracket": "]",
    "left_curly_bracket": "{",
    "right_curly_bracket": "}",
}


def key_label(key: str) -> str:
    """A bound key as people write it: `?` (not question_mark), `F1`, `Esc`, `ctrl+s`, `space`, `X`."""
    key = key.strip()
    if re.fullmatch(r"f\d+", key):
        return key.upper()
    return _NAMES.get(key, key)


def keys_label(binding: Binding) -> str:
    """Every key of a binding: `?, F1`."""
    return ", ".join(key_label(key) for key in binding.key.split(","))
