"""`kvtui replay TRACE`: a recorded step trace in the step viewer (`--follow`: as another process writes it), or
a server trace (`kvtui attach --trace`) in the server view; `--print` says a server trace's summary headless."""

from __future__ import annotations

from pathlib import Path

import click

from ..options import DEFAULT_THEME
from . import bad_input as _bad_input
from . import check_theme as _check_theme


@click.command("replay")
@click.argument("trace_path", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--theme", default=DEFAULT_THEME, show_default=True)
@click.option(
    "--follow",
    is_flag=True,
    help="Keep reading: show steps as another process appends them (waits for a file not created yet; starts "
    "again from the top when the program rewrites it).",
)
@click.option(
    "--print",
    "print_only",
    is_flag=True,
    help="A server trace (kvtui attach --trace): print its summary and notes instead of opening the TUI.",
)
def replay(trace_path, theme, follow, print_only):
    """Open the TUI on a recorded trace (no model needed): space/u step, r plays. A server trace (kvtui attach
    --trace) opens the attach screen on the prefix cache its events rebuild."""
    from ..engine.records.trace import TraceError
    from ..engine.server.server_trace import is_server_trace

    if is_server_trace(trace_path):
        _replay_server_trace(trace_path, theme, follow, print_only)
        return
    if print_only:
        _bad_input(f"{trace_path}: --print is for server traces (kvtui attach --trace); this is a step trace")
    _check_theme(theme)
    try:
        from .. import viewers

        app = viewers.replay(trace_path, theme_name=theme, follow=follow)
    except TraceError as exc:
        _bad_input(str(exc))
    app.run()


def _replay_server_trace(trace_path: Path, theme: str, follow: bool, print_only: bool) -> None:
    from ..engine.server.report import summary_lines
    from ..engine.server.server_trace import ServerTraceError, load_server_trace

    if follow:
        _bad_input(f"{trace_path}: --follow reads step traces; a server trace is replayed whole")
    if not print_only:
        _check_theme(theme)
    try:
        run = load_server_trace(trace_path)
    except ServerTraceError as exc:
        _bad_input(str(exc))
    if print_only:
        for line in summary_lines(run.cache):
            click.echo(f"kvtui: {line}")
        for note in run.cache.notes:
            click.echo(f"kvtui: {note.severity} {note.code}: {note.message}")
        return
    from .. import viewers

    viewers.server(run=run, theme_name=theme).run()
