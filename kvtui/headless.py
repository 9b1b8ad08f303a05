"""The headless runner: a scripted chat through the engine, a trace on disk, a readable summary."""

from __future__ import annotations

import time
from collections.abc import Callable

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .engine.chat.script import Script
from .engine.chat.session import ChatSession, SessionError
from .engine.reading.export import export_cache
from .engine.records.diagnostic_groups import group_diagnostics, group_last, group_summary
from .engine.records.recorder import Recorder, failing
from .engine.records.snapshot import Diagnostic, RequestView, StepSnapshot
from .engine.records.token_bytes import ending_on, unfinished_tail
from .fmt import one_line, printable

STYLE = {"info": "cyan", "warning": "yellow", "error": "bold red"}
COLUMNS = (  # (name, justify) of the summary table: one row per turn
    ("turn", "right"),
    ("you", "left"),
    ("model", "left"),
    ("fed", "right"),
    ("new", "right"),
    ("cache", "right"),
    ("tok/s", "right"),
    ("alarms", "left"),
)


def run_script(
    session: ChatSession,
    script: Script,
    *,
    trace_path=None,
    model_source: str = "",
    model_path: str = "",
    verify_every: int = 0,
    fail_on: str = "error",
    console: Console | None = None,
    export: tuple[int, object] | None = None,
    verbose: bool = False,
) -> int:
    """Run every turn; returns the exit code (1 when a diagnostic at or above `fail_on` fired).

    The summary has one line per turn (texts cut with …) unless `verbose`, which prints them whole.
    Every text from the user or the model is printed with its control characters escaped.
    """
    console = console or Console()
    recorder = Recorder(
        session, trace_path, model_source=model_source, model_path=model_path, verify_every=verify_every
    )
    exported: list = []

    def export_at_step(snapshot: StepSnapshot) -> None:
        if export and snapshot.step == export[0]:
            exported.append(export_cache(session, export[1]))

    session.on_snapshot.add(export_at_step)
    table = _turn_table(session, model_source, verbose)
    shown = (lambda s: printable(s, newlines=True)) if verbose else one_line
    try:
        for text in script.turns:
            table.add_row(*_run_turn(session, text, shown))
    finally:
        session.on_snapshot.remove(export_at_step)
        recorder.close()
    console.print(table)
    _print_footer(console, session, trace_path, export, exported)
    failed = failing(session.diagnostics, fail_on)
    if failed:
        console.print(f"[bold red]{len(failed)} diagnostic(s) at or above {fail_on}[/]")
        return 1
    return 0


def alarm_summary(diagnostics: list[Diagnostic], *, label: str = "", markup: bool = False) -> list[str]:
    """The alarms in a few lines: one per code and cache, errors first, each followed by its last message.

    `label` goes before each summary (a process's name); `markup`: the severity in colour and every text
    escaped, for a Rich console (else plain text, for click.echo)."""
    lines = []
    for group in group_diagnostics(diagnostics):
        severity, summary = f"{group.severity:>7}", printable(group_summary(group))
        if markup:
            severity, summary = f"[{STYLE[group.severity]}]{severity}[/]", escape(summary)
        lines.append(f"{severity} {label}{summary}")
        last = group_last(group)
        if last is not None:
            lines.append(f"        {escape(printable(last)) if markup else printable(last)}")
    return lines


def request_summary(requests: dict[tuple[str | None, str], RequestView], *, label: str = "") -> list[str]:
    """One line per request of a continuous-batching run, in arrival order: `requests` holds each request's last
    view by (cache, request id). A request still decoding when the run ended finished with its last forward
    (transformers drops it from the batch after sampling its last token: no forward sees it finished)."""
    lines = []
    for (cache_id, _), view in requests.items():
        status = "finished" if view.status == "decoding" else view.status
        blocks = ", ".join(f"{group} {len(table)}" for group, table in view.blocks) or "none"
        lines.append(
            f"{label}request {view.request_id} ({cache_id}): prompt {view.prompt_length} tokens · generated "
            f"{view.generated} · prefix hit {view.prefix_hit} · recomputed {view.recomputed} · blocks {blocks} "
            f"(shared {view.shared}) · "
            + (f"requeued {view.requeued} (computed again {view.reprefilled}) · " if view.requeued else "")
            + status
        )
    return lines


def requests_of(records) -> dict[tuple[str | None, str], RequestView]:
    """The last view of every request in a process's step records (dicts, as the trace carries them)."""
    from .engine.records.codec import from_record

    found: dict[tuple[str | None, str], RequestView] = {}
    for record in records:
        if record.get("type") == "step" and record.get("requests"):
            for view in record["requests"]:
                found[(record.get("cache_id"), view["request_id"])] = from_record(RequestView, view)
    return found


def _turn_table(session: ChatSession, model_source: str, verbose: bool) -> Table:
    """The summary table's title and columns (texts cut with … unless `verbose`)."""
    table = Table(
        title=escape(
            f"kvtui · {printable(model_source or 'model')} · {session.config.cache} cache · "
            + (f"press {session.config.press} · " if session.config.press else "")
            + f"{session.config.sampler.describe()}"
        ),
        expand=True,
    )
    for column, justify in COLUMNS:
        text = column in ("you", "model", "alarms")
        table.add_column(
            column,
            justify=justify,
            overflow="fold" if verbose or not text else "ellipsis",
            no_wrap=not (verbose and text),
            ratio=2 if column in ("you", "model") else None,
        )
    return table


def _run_turn(session: ChatSession, text: str, shown: Callable[[str], str]) -> tuple[str, ...]:
    """Send one user turn and generate the reply; its row of the summary table (a refusal in red)."""
    before_diag, before_len = len(session.diagnostics), session.cache_length
    started, fed, generated = time.perf_counter(), 0, 0
    error, turn = None, "-"  # a send refused before its prefill (a full static cache) starts no turn
    prefill = None
    try:
        prefill = session.send(text)
        turn, fed = str(session.turn), len(prefill.input_ids)
        session.generate()
    except SessionError as exc:
        error = str(exc)
    if prefill is not None:  # the steps made after the prefill, a turn cut short (a full static cache) included
        generated = session.steps - prefill.step
    elapsed = time.perf_counter() - started
    reply = session.messages[-1]["content"] if session.messages and session.messages[-1]["role"] == "assistant" else ""
    tail = unfinished_tail(session.buffer, session.token_bytes)
    reply = ending_on(reply, tail)  # a reply cut inside a character ends on its bytes, as the TUI shows it
    codes = ", ".join(sorted({d.code for d in session.diagnostics[before_diag:]}))
    return (
        turn,
        escape(shown(text)),
        escape(shown(reply)) if not error else f"[red]{escape(shown(error))}[/]",
        str(fed),
        str(generated),
        f"{before_len}→{session.cache_length}",
        f"{generated / elapsed:.1f}" if generated and elapsed > 0 else "-",
        codes or "-",
    )


def _print_footer(console: Console, session: ChatSession, trace_path, export, exported: list) -> None:
    """Below the table: compile costs, the alarm summary, where the trace and the exported cache went."""
    if session.config.compile:
        console.print(
            f"--compile: {session.compiles} graph(s) compiled in {session.compile_ms_total / 1000:.1f} s "
            f"(inside the first turn's tok/s), {session.recompiles} recompile(s)",
            highlight=False,
        )
    for line in alarm_summary(session.diagnostics, markup=True):
        console.print(line, highlight=False)
    if trace_path:
        console.print(f"trace written to {escape(printable(trace_path))}")
    if export:
        console.print(
            f"cache at step {export[0]} exported to {exported[0]}"
            if exported
            else f"[yellow]no cache exported: the run ended before step {export[0]}[/]"
        )
