"""`kvtui watch [OPTIONS] SCRIPT [ARGS]...` / `kvtui watch -m MODULE [ARGS]...`: run an unmodified
program and show what its cache does (TUI, live), or record it (--headless)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import click

from ..engine.snapshot import SEVERITIES


@click.command("watch", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False,
                                          "help_option_names": ["-h", "--help"]})
@click.option("-m", "module", is_flag=True, help="TARGET is a module to run as `python -m MODULE`.")
@click.option("--headless", is_flag=True, help="No TUI: run the program, pass its output through, print the alarms.")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the JSON Lines trace here (schema 1, watch fields).")
@click.option("--fail-on", type=click.Choice(SEVERITIES), default="error", show_default=True,
              help="Headless: exit 1 when an alarm at or above this fired (else the program's own exit code).")
@click.option("--paused", is_flag=True, help="TUI: hold the program before its first forward.")
@click.option("--break-on-alarm", is_flag=True, help="TUI: pause right after a step that raised a warning or error (b).")
@click.option("--show-top", type=click.IntRange(1, 100), default=10, show_default=True)
@click.option("--theme", default="kvtui-dark", show_default=True, help="TUI theme.")
@click.argument("target")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def watch(module, headless, trace_path, fail_on, paused, break_on_alarm, show_top, theme, target, args):
    """Run a program that uses transformers and watch every causal LM it loads: each top-level forward
    becomes a step (tokens fed, positions applied vs asked for, cache per layer, top-k) and the cache
    bugs it makes are named with the line that made them."""
    if module:
        if importlib.util.find_spec(target.split(".")[0]) is None and not Path(target.replace(".", "/")).exists():
            raise click.BadParameter(f"no module named {target!r}", param_hint="-m")
    elif not Path(target).is_file():
        raise click.BadParameter(f"{target}: no such file", param_hint="SCRIPT")
    if trace_path is not None and trace_path.parent and not trace_path.parent.exists():
        raise click.BadParameter(f"{trace_path.parent}: no such directory", param_hint="--trace")
    if not headless:
        from ..themes import theme_error

        if theme_error(theme):
            raise click.BadParameter(theme_error(theme), param_hint="--theme")
    if headless:
        sys.exit(run_headless(target, list(args), module, trace_path, fail_on, show_top))
    from ..watch_app import WatchApp

    app = WatchApp(target, list(args), module=module, trace_path=trace_path, paused=paused,
                   break_on_alarm=break_on_alarm, top_k=show_top, theme_name=theme)
    app.run()
    sys.exit(app.return_code or 0)


def run_headless(target: str, args: list[str], module: bool, trace_path, fail_on: str, top_k: int = 10) -> int:
    """Run the program in this process under the probe; exit 1 if an alarm at/above fail_on fired,
    else the program's own exit code."""
    from ..engine.probe import Watcher, run_watched
    from ..engine.recorder import failing
    from ..fmt import printable

    watcher = Watcher(trace=str(trace_path) if trace_path else None, top_k=top_k, program=[target, *args])
    code, watched = run_watched(watcher, target, args, module=module)
    models = ", ".join(watched) or "none"
    err = click.get_text_stream("stderr")
    click.echo(f"kvtui watch: {watcher.steps} forwards watched · models: {printable(models)} · "
               f"program exit code {code}", file=err)
    for d in watcher.diagnostics:
        click.echo(f"{d.severity:>7} step {d.step:>4}  {d.code}  {printable(d.message)}", file=err)
    click.echo(f"waste: {watcher.summary()}", file=err)
    if trace_path:
        click.echo(f"trace written to {trace_path}", file=err)
    failed = failing(watcher.diagnostics, fail_on)
    if failed:
        click.echo(f"{len(failed)} alarm(s) at or above {fail_on}", file=err)
        return 1
    return code
