"""The IPython hook `import kvtui` installs: kvtui's objects shown as HTML in Jupyter, VS Code or Colab.

Kept apart from kvtui.notebook (Rich and the widgets' renderers): this module imports nothing, and the
formatters import kvtui.notebook the first time an object is shown.
"""

from __future__ import annotations

import sys

SHOWN = (
    ("kvtui.engine.records.snapshot", "StepSnapshot"),
    ("kvtui.engine.watch.probe", "Watcher"),
    ("kvtui.engine.records.replay", "Replay"),
)


def register_formatters() -> None:
    """Only when IPython is already loaded and running a shell; elsewhere nothing happens (call it again
    after starting IPython in a process that imported kvtui first)."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return
    try:
        shell = ipython.get_ipython()
        if shell is None:
            return
        formatter = shell.display_formatter.formatters["text/html"]
    except Exception:  # noqa: BLE001  an IPython without the usual formatters: plain reprs
        return
    for module, name in SHOWN:
        formatter.for_type_by_name(module, name, _html)  # by name: nothing is imported until one is shown


def _html(obj):
    from .notebook import html

    return html(obj)
