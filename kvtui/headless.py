"""The headless runner: a scripted chat through the engine, a trace on disk, a readable summary."""

from __future__ import annotations

import time
from dataclasses import asdict

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .engine.export import export_cache
from .engine.session import ChatSession, SessionError
from .engine.script import Script
from .engine.snapshot import SEVERITIES, StepSnapshot, buffer_record
from .engine.trace import TraceWriter, header_record

STYLE = {"info": "cyan", "warning": "yellow", "error": "bold red"}


def run_script(session: ChatSession, script: Script, *, trace_path=None, model_source: str = "", model_path: str = "",
               verify_every: int = 0, fail_on: str = "error", console: Console | None = None,
               export: tuple[int, object] | None = None) -> int:
    """Run every turn; returns the exit code (1 when a diagnostic at or above `fail_on` fired)."""
    console = console or Console()
    writer = TraceWriter(trace_path, header_record(session, model_source, model_path)) if trace_path else None
    steps_at_verify = [0]

    in_steps: set[int] = set()  # diagnostics already written inside a step line
    exported: list = []

    def on_snapshot(snapshot: StepSnapshot) -> None:
        in_steps.update(id(d) for d in snapshot.diagnostics)
        if writer:
            writer.write(snapshot.to_record())
        if export and snapshot.step == export[0]:
            exported.append(export_cache(session, export[1]))
        if verify_every and snapshot.step - steps_at_verify[0] >= verify_every:
            steps_at_verify[0] = snapshot.step
            result = session.verify()
            if writer:
                writer.write({"type": "verify", "step": snapshot.step, **asdict(result)})

    session.on_snapshot = on_snapshot
    table = Table(title=f"kvtui · {model_source or 'model'} · {session.config.cache} cache · "
                        f"{session.config.sampler.describe()}", expand=True)
    for column, justify in (("turn", "right"), ("you", "left"), ("model", "left"), ("fed", "right"),
                            ("new", "right"), ("cache", "right"), ("tok/s", "right"), ("alarms", "left")):
        table.add_column(column, justify=justify, overflow="fold")
    try:
        for number, text in enumerate(script.turns, start=1):
            before_diag, before_len = len(session.diagnostics), session.cache_length
            started, fed, generated = time.perf_counter(), 0, 0
            error = None
            try:
                prefill = session.send(text)
                fed = len(prefill.input_ids)
                last = session.generate()
                generated = (last.step - prefill.step) if last else 0
            except SessionError as exc:
                error = str(exc)
            elapsed = time.perf_counter() - started
            if writer:
                # refusals and verify results happen outside a forward: they get lines of their own
                for d in session.diagnostics[before_diag:]:
                    if id(d) not in in_steps:
                        writer.write({"type": "diagnostic", "step": d.step, "code": d.code, "severity": d.severity,
                                      "message": d.message})
                writer.write(buffer_record(session.buffer))
            reply = session.messages[-1]["content"] if session.messages and session.messages[-1]["role"] == "assistant" else ""
            new_diags = session.diagnostics[before_diag:]
            codes = ", ".join(sorted({d.code for d in new_diags}))
            table.add_row(str(number), escape(_short(text)), escape(_short(reply)) if not error else f"[red]{escape(error)}[/]",
                          str(fed), str(generated), f"{before_len}→{session.cache_length}",
                          f"{generated / elapsed:.1f}" if generated and elapsed > 0 else "-", codes or "-")
    finally:
        session.on_snapshot = None
        if writer:
            writer.close()
    console.print(table)
    if session.config.compile:
        console.print(f"--compile: {session.compiles} graph(s) compiled in {session.compile_ms_total / 1000:.1f} s "
                      f"(inside the first turn's tok/s), {session.recompiles} recompile(s)", highlight=False)
    for d in session.diagnostics:
        console.print(f"[{STYLE[d.severity]}]{d.severity:>7}[/] step {d.step:>4}  [bold]{d.code}[/]  {escape(d.message)}",
                      highlight=False)
    if trace_path:
        console.print(f"trace written to {trace_path}")
    if export:
        console.print(f"cache at step {export[0]} exported to {exported[0]}" if exported
                      else f"[yellow]no cache exported: the run ended before step {export[0]}[/]")
    threshold = SEVERITIES.index(fail_on)
    failing = [d for d in session.diagnostics if SEVERITIES.index(d.severity) >= threshold]
    if failing:
        console.print(f"[bold red]{len(failing)} diagnostic(s) at or above {fail_on}[/]")
        return 1
    return 0


def _short(text: str, limit: int = 80) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
