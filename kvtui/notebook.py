"""kvtui in a notebook (Jupyter, VS Code, Colab): the watch handle, a StepSnapshot and a replayed trace show
themselves inline, drawn by the panes' own pure render functions (kvtui/widgets/*) and exported to HTML by Rich.

Design: the engine stays free of Rich (its objects have no `_repr_html_`). `import kvtui` asks IPython, when
one is running, to format those classes by *name* (`for_type_by_name`: nothing is imported until an object
is shown), and the formatter imports this module. So a snapshot renders the same whether it came from
`kvtui.watch`, a session or `kvtui.replay(path)`, and the terminal tools never pay for any of this.

`kvtui.watch(model, tokenizer, display="live")` adds a `LiveDisplay`: one output per cell, updated in place
while generate() or a loop runs. It is throttled on the model's thread by a clock check (no thread, no
timer): an update at most every MIN_INTERVAL seconds and never more often than keeps rendering under
1/COST_FACTOR of the time; the step left pending is drawn when the cell ends (IPython's post_run_cell).

Every render is guarded: an error becomes one short line in the output, never an exception in the user's cell.
"""

from __future__ import annotations

import html as _html
import io
import time
import weakref

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from .engine.records.snapshot import StepSnapshot
from .widgets.shared.palette import DEFAULT_PALETTE, role_style
from .widgets.step.attention_strip import render_heatmap
from .widgets.step.cursor_pane import render_cursor
from .widgets.step.diagnostics_pane import COLUMNS as ALARM_COLUMNS
from .widgets.step.diagnostics_pane import diagnostic_cells, severity_counts, title_for
from .widgets.step.layers_pane import COLUMNS as LAYER_COLUMNS
from .widgets.step.layers_pane import layer_rows, render_totals
from .widgets.step.token_buffer import render_strip
from .widgets.step.topk_pane import columns as topk_columns
from .widgets.step.topk_pane import render_header as topk_header
from .widgets.step.topk_pane import topk_rows

WIDTH = 120  # console cells of the export
STRIP_LIMIT = 600  # tokens of the strip shown (the newest); earlier ones are counted
LIVE_STRIP_LIMIT = 200  # ... while a loop runs
ALARMS_SHOWN = 20  # the newest alarms listed (all are counted in the title)
MIN_INTERVAL = 0.25  # seconds between two live updates at most (4 per second)
COST_FACTOR = 50  # and at least 50x the last render's cost apart: rendering stays under 2% of the loop's time
BACKGROUND, FOREGROUND = "#1e1e1e", "#e0e0e0"
CODE_FORMAT = (
    '<div class="kvtui-view"><pre style="font-family:Menlo,\'DejaVu Sans Mono\',Consolas,monospace;'
    "font-size:12px;line-height:1.3;color:" + FOREGROUND + ";background-color:" + BACKGROUND + ";padding:8px;"
    'border-radius:4px;white-space:pre-wrap;overflow-x:auto"><code '
    'style="font-family:inherit">{code}</code></pre></div>'
)


def _rule(title: str) -> Text:
    return Text(f"── {title} ", style=role_style(DEFAULT_PALETTE, "accent", "bold"))


def _table(columns, rows) -> Table:
    table = Table(box=None, pad_edge=False, show_edge=False, header_style=role_style(DEFAULT_PALETTE, "muted", "bold"))
    for _, label in columns:
        table.add_column(label)
    for cells in rows:
        table.add_row(*cells)
    return table


def _alike_rows_merged(rows) -> list[tuple[Text, ...]]:
    """The layers pane's rows, with a run of layers whose every cell but the index is the same drawn once
    ("0–29"): 30 identical rows say less than one, and cost a notebook 30 times the HTML."""
    merged: list[list] = []
    for row in rows:
        cells = row.cells
        if merged and [c.plain for c in merged[-1][1][1:]] == [c.plain for c in cells[1:]]:
            merged[-1][2] = row.index
        else:
            merged.append([row.index, cells, row.index])
    out = []
    for first, cells, last in merged:
        index = Text(str(first) if first == last else f"{first}–{last}", justify="right")
        out.append((index, *cells[1:]))
    return out


def snapshot_view(
    snapshot: StepSnapshot | None, diagnostics=None, *, title: str | None = None, strip_limit: int | None = STRIP_LIMIT
):
    """One step as the TUI shows it: cursor, token strip, layers, top-k and alarms (Rich renderables, from the
    panes' own functions). `diagnostics`: every alarm so far (default: the step's own)."""
    palette = DEFAULT_PALETTE
    parts: list = []
    heading = Text("kvtui", style=role_style(palette, "accent", "bold"))
    if title:
        heading.append(f" · {title}", style=role_style(palette, "muted"))
    if snapshot is not None:
        extras = [snapshot.lineage, snapshot.caller, snapshot.model]
        heading.append("".join(f" · {e}" for e in extras if e), style=role_style(palette, "muted"))
    parts.append(heading)
    if snapshot is None:
        parts.append(
            Text(
                "no forward yet: run generate() or the model, then show this again",
                style=role_style(palette, "muted", "italic"),
            )
        )
        return Group(*parts)
    parts.append(render_cursor(snapshot, palette))
    parts.append(
        _rule(f"tokens ({len(snapshot.buffer)} {'in context, no cache' if snapshot.uncached else 'in the cache'})")
    )
    parts.append(render_strip(snapshot, palette, strip_limit))
    if snapshot.attention is not None:  # --attention / watch(attention=True)
        parts.append(_rule("attention of the newest token (layers × positions)"))
        parts.append(render_heatmap(snapshot, WIDTH, palette))
    parts.append(_rule("layers"))
    parts.append(render_totals(snapshot, palette=palette))
    if snapshot.layers:
        parts.append(_table(LAYER_COLUMNS, _alike_rows_merged(layer_rows(snapshot, palette))))
    parts.append(_rule("top-k"))
    parts.append(topk_header(snapshot, "processed", palette))
    parts.append(_table(topk_columns("processed"), [row.cells for row in topk_rows(snapshot, "processed", palette)]))
    alarms = tuple(snapshot.diagnostics if diagnostics is None else diagnostics)
    parts.append(_rule(title_for(severity_counts(alarms)) if alarms else "diagnostics · none"))
    if alarms:
        shown = alarms[-ALARMS_SHOWN:]
        if len(shown) < len(alarms):
            parts.append(Text(f"… {len(alarms) - len(shown)} earlier alarms", style=role_style(palette, "muted")))
        parts.append(_table(ALARM_COLUMNS, [diagnostic_cells(d, palette, width=WIDTH - 30) for d in shown]))
    return Group(*parts)


def view(obj, strip_limit: int | None = STRIP_LIMIT):
    """The renderable for a Watcher (its newest step, every alarm so far), a StepSnapshot or a Replay."""
    from .engine.records.replay import Replay
    from .engine.watch.probe import Watcher

    if isinstance(obj, Watcher):
        state = f"watching {', '.join(p.name for p in obj.probes)}" if obj.probes else "detached"
        return snapshot_view(
            obj.last, tuple(obj.diagnostics), title=f"{state} · {obj.steps} forwards", strip_limit=strip_limit
        )
    if isinstance(obj, Replay):
        last = obj.snapshots[-1] if obj.snapshots else None
        return snapshot_view(
            last, obj.diagnostics, title=f"{obj.describe()} · {len(obj)} steps", strip_limit=strip_limit
        )
    if isinstance(obj, StepSnapshot):
        return snapshot_view(obj, strip_limit=strip_limit)
    raise TypeError(f"kvtui cannot show a {type(obj).__name__}")


def to_html(renderable, width: int = WIDTH) -> str:
    """A renderable as an HTML fragment with inline styles (Rich escapes every text it exports)."""
    console = Console(
        record=True,
        width=width,
        file=io.StringIO(),
        force_terminal=True,
        color_system="truecolor",
        legacy_windows=False,
        force_jupyter=False,
    )  # in a kernel Rich would display() it itself
    console.print(renderable)
    return console.export_html(inline_styles=True, code_format=CODE_FORMAT)


def html(obj, strip_limit: int | None = STRIP_LIMIT) -> str:
    """`obj` as HTML for a notebook output. Never raises: a failure is one short line instead."""
    try:
        return to_html(view(obj, strip_limit))
    except Exception as exc:  # noqa: BLE001  a render must never stop the user's cell
        return render_error(obj, exc)


def render_error(obj, exc: BaseException) -> str:
    message = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
    return (
        f'<pre class="kvtui-error">kvtui could not draw this {_html.escape(type(obj).__name__)}: '
        f"{_html.escape(message)}</pre>"
    )


class _HTML:
    """What IPython's display() shows: just the HTML (IPython.display.HTML warns about some fragments)."""

    def __init__(self, text: str):
        self.text = text

    def _repr_html_(self) -> str:
        return self.text


_LIVE: weakref.WeakKeyDictionary | None = None  # watcher -> its LiveDisplay (kvtui's own registry, not an attribute)


def live_display(watcher) -> LiveDisplay | None:
    """The live display of a watch made with display="live" (its `updates` count what it drew)."""
    return None if _LIVE is None else _LIVE.get(watcher)


class LiveDisplay:
    """The output a watch updates in place while the model runs (display="live"); see the module docstring."""

    def __init__(self, watcher=None, shell=None):
        from IPython import get_ipython

        self.shell = shell or get_ipython()
        if self.shell is None:
            raise RuntimeError('display="live" needs a notebook (IPython kernel): none is running')
        self.watcher = watcher
        self.updates = 0  # outputs drawn or updated so far
        self.render_s = 0.0  # time spent rendering, in total
        self._handle = None
        self._cell = 0  # cells run since this display was made (pre_run_cell counts them)
        self._shown_cell = -1  # the cell its output is under
        self._pending: StepSnapshot | None = None
        self._shown: StepSnapshot | None = None
        self._next = 0.0  # perf_counter time of the next redraw allowed (0: no step seen yet)
        self.shell.events.register("pre_run_cell", self._before_cell)
        self.shell.events.register("post_run_cell", self._after_cell)

    def __call__(self, snapshot: StepSnapshot) -> None:
        """on_snapshot, on the model's thread: a reference kept, and a render only when the clock allows."""
        self._pending = snapshot
        now = time.perf_counter()
        if (
            self._next == 0.0
        ):  # the first step: draw once the loop has run MIN_INTERVAL (a short loop is drawn at its end)
            self._next = now + MIN_INTERVAL
        elif now >= self._next:
            self._draw(now)

    def _draw(self, now: float) -> None:
        snapshot = self._pending
        diagnostics = tuple(self.watcher.diagnostics) if self.watcher is not None else None
        try:
            text = to_html(snapshot_view(snapshot, diagnostics, title="live", strip_limit=LIVE_STRIP_LIMIT))
        except Exception as exc:  # noqa: BLE001
            text = render_error(snapshot, exc)
        self._publish(text)
        self._shown = snapshot
        cost = time.perf_counter() - now
        self.render_s += cost
        self._next = now + max(MIN_INTERVAL, cost * COST_FACTOR)

    def _publish(self, text: str) -> None:
        from IPython.display import display

        try:
            if self._handle is None or self._shown_cell != self._cell:  # a new cell: a new output under it
                self._handle, self._shown_cell = display(_HTML(text), display_id=True), self._cell
            else:
                self._handle.update(_HTML(text))
            self.updates += 1
        except Exception:  # noqa: BLE001  a closed front end: the model goes on
            pass

    def bind(self, watcher) -> None:
        global _LIVE
        if _LIVE is None:
            _LIVE = weakref.WeakKeyDictionary()
        self.watcher = watcher
        _LIVE[watcher] = self

    def _before_cell(self, *_args) -> None:
        self._cell += 1

    def _after_cell(self, *_args) -> None:
        if self._pending is not None and self._pending is not self._shown:
            self._draw(time.perf_counter())
        if self.watcher is not None and not self.watcher.probes:
            self.close()

    def close(self) -> None:
        for event, callback in (("pre_run_cell", self._before_cell), ("post_run_cell", self._after_cell)):
            try:
                self.shell.events.unregister(event, callback)
            except ValueError:
                pass
