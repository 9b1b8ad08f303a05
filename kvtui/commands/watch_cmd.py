"""`kvtui watch [OPTIONS] SCRIPT [ARGS]...` / `kvtui watch -m MODULE [ARGS]...`: run an unmodified
program and show what its cache does (TUI, live), or record it (--headless).
`kvtui watch --headless [OPTIONS] -- COMMAND [ARGS]...`: any command (torchrun, pytest, a shell script):
every Python process of its tree that builds a causal LM is watched (kvtui/engine/watch/tree.py)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import click

from ..engine.records.snapshot import SEVERITIES


@click.command(
    "watch",
    context_settings={
        "ignore_unknown_options": True,
        "allow_interspersed_args": False,
        "help_option_names": ["-h", "--help"],
    },
)
@click.option("-m", "module", is_flag=True, help="TARGET is a module to run as `python -m MODULE`.")
@click.option("--headless", is_flag=True, help="No TUI: run the program, pass its output through, print the alarms.")
@click.option(
    "--trace",
    "trace_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the JSON Lines trace here (schema 1, watch fields).",
)
@click.option(
    "--fail-on",
    type=click.Choice(SEVERITIES),
    default="error",
    show_default=True,
    help="Headless: exit 1 when an alarm at or above this fired (else the program's own exit code).",
)
@click.option("--paused", is_flag=True, help="TUI: hold the program before its first forward.")
@click.option(
    "--break-on-alarm", is_flag=True, help="TUI: pause right after a step that raised a warning or error (b)."
)
@click.option("--show-top", type=click.IntRange(1, 100), default=10, show_default=True)
@click.option("--theme", default="kvtui-dark", show_default=True, help="TUI theme.")
@click.option(
    "--attention",
    is_flag=True,
    help="Capture every layer's attention of each step's newest token (any attention implementation).",
)
@click.option(
    "--listen",
    metavar="HOST:PORT",
    default=None,
    help="-- COMMAND: also watch processes of other machines that connect here (prints the token).",
)
@click.option(
    "--connect",
    metavar="HOST:PORT",
    default=None,
    help="-- COMMAND: send this machine's processes to a viewer started with --listen.",
)
@click.option("--token", default=None, help="With --connect: the token the viewer printed.")
@click.argument("target")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def watch(
    module,
    headless,
    trace_path,
    fail_on,
    paused,
    break_on_alarm,
    show_top,
    theme,
    attention,
    listen,
    connect,
    token,
    target,
    args,
):
    """Run a program that uses transformers and watch every causal LM it loads: each top-level forward
    becomes a step (tokens fed, positions applied vs asked for, cache per layer, top-k) and the cache
    bugs it makes are named with the line that made them."""
    if not headless and connect is None:  # a screen opens: its theme is checked first (one check, options.py)
        from . import check_theme

        check_theme(theme)
    if trace_path is not None:  # whichever runs the program (one process, a tree, the TUI): before it starts
        _check_trace(trace_path)
    if module:
        top = target.split(".")[0]  # found as python -m finds it: the current folder first (a console script's
        # own sys.path lacks it), then the installed ones
        if not (Path(top).is_dir() or Path(f"{top}.py").is_file()) and importlib.util.find_spec(top) is None:
            raise click.BadParameter(f"no module named {target!r}", param_hint="-m")
    elif not _is_script(target):
        if target.endswith(".py"):
            raise click.BadParameter(f"{target}: no such file", param_hint="SCRIPT")
        executable = shutil.which(target)
        if executable is None:
            click.echo(f"kvtui watch: {target}: no such script or command", err=True)
            sys.exit(2)
        if connect is not None and not token:
            raise click.BadParameter("--connect needs the --token the viewer printed", param_hint="--token")
        if headless or connect is not None:
            sys.exit(
                run_tree_headless(
                    executable, target, list(args), trace_path, fail_on, show_top, listen, connect, token, attention
                )
            )
        sys.exit(
            run_tree_tui(
                executable, target, list(args), trace_path, show_top, listen, paused, break_on_alarm, theme, attention
            )
        )
    if headless:
        sys.exit(run_headless(target, list(args), module, trace_path, fail_on, show_top, attention))
    from .. import viewers

    app = viewers.watch(
        target,
        list(args),
        module=module,
        trace_path=trace_path,
        paused=paused,
        break_on_alarm=break_on_alarm,
        top_k=show_top,
        theme_name=theme,
        attention=attention,
    )
    app.run()
    sys.exit(app.return_code or 0)


def run_headless(
    target: str, args: list[str], module: bool, trace_path, fail_on: str, top_k: int = 10, attention: bool = False
) -> int:
    """Run the program in this process under the probe (made when its imports reach transformers: deferred.py);
    exit 1 if an alarm at/above fail_on fired, else the program's own exit code."""
    from ..engine.watch.deferred import run_deferred
    from ..fmt import printable

    off: dict[str, int] = {}  # --attention: why steps carried none (one line each, with their count)

    def seen(snapshot) -> None:
        if snapshot.attention_off:
            off[snapshot.attention_off] = off.get(snapshot.attention_off, 0) + 1

    def make_watcher():
        from ..engine.watch.probe import Watcher

        return Watcher(
            trace=str(trace_path.absolute()) if trace_path else None,  # made later: the program may have changed folder
            top_k=top_k,
            program=[target, *args],
            attention=attention,
            on_snapshot=seen if attention else None,
        )

    code, watcher, watched = run_deferred(make_watcher, target, args, module=module)
    models = ", ".join(watched) or "none"
    err = sys.stderr
    steps = watcher.steps if watcher is not None else 0
    click.echo(
        f"kvtui watch: {steps} forwards watched · models: {printable(models)} · program exit code {code}", file=err
    )
    if watcher is None:  # the program never imported transformers' model or tokenizer code
        if trace_path:
            click.echo(f"no trace written to {trace_path}: no forward was watched", file=err)
        return code
    # the report's modules after the program (imported before it, they would import torch ahead of it)
    from ..engine.records.recorder import failing
    from ..headless import alarm_summary, request_summary

    for line in alarm_summary(watcher.diagnostics):  # one line per code and cache, errors first
        click.echo(line, file=err)
    for line in request_summary(watcher.requests):  # continuous batching: one line per request
        click.echo(printable(line), file=err)
    for reason, count in off.items():
        click.echo(f"{printable(reason)} ({count} step(s))", file=err)
    click.echo(f"waste: {watcher.summary()}", file=err)
    if trace_path:  # the file opens at the first forward
        if watcher.recorder is not None:
            click.echo(f"trace written to {trace_path}", file=err)
        elif watcher.steps:
            click.echo(f"no trace written to {trace_path}: it could not be opened (the worker-error above)", file=err)
        else:
            click.echo(f"no trace written to {trace_path}: no forward was watched", file=err)
    failed = failing(watcher.diagnostics, fail_on)
    if failed:
        click.echo(f"{len(failed)} alarm(s) at or above {fail_on}", file=err)
        return 1
    return code


def _check_trace(path: Path) -> None:
    """The trace can be written there: else a clear error before the program runs (its file opens only at the
    program's first forward). A file this check makes is removed again."""
    if path.parent and not path.parent.exists():
        raise click.BadParameter(f"{path.parent}: no such directory", param_hint="--trace")
    existed = path.exists()
    try:
        with open(path, "ab"):
            pass
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise click.BadParameter(f"{path}: cannot write the trace: {reason}", param_hint="--trace") from None
    if not existed:
        path.unlink(missing_ok=True)


def _is_script(target: str) -> bool:
    """A Python file run as `python FILE` (as before): a .py file, or any file that is not an executable."""
    path = Path(target)
    return path.is_file() and (path.suffix == ".py" or not os.access(path, os.X_OK))


def run_tree_tui(
    executable: str,
    command: str,
    args: list[str],
    trace_path,
    top_k: int,
    listen: str | None,
    paused: bool,
    break_on_alarm: bool,
    theme: str,
    attention: bool = False,
) -> int:
    """The watch TUI over a command's tree: every watched process's steps in one timeline (M picks one
    process), pause / step / run / break on alarm for all of them at once, the command's output and stdin."""
    from .. import viewers
    from ..engine.watch.tree_source import TreeSource

    try:
        source = TreeSource(
            executable,
            args,
            top_k=top_k,
            paused=paused,
            break_on_alarm=break_on_alarm,
            listen=listen,
            trace=trace_path,
            attention=attention,
        )
    except (OSError, ValueError) as error:
        click.echo(f"kvtui watch: {command}: cannot run: {getattr(error, 'strerror', None) or error}", err=True)
        return 2
    app = viewers.watch(
        source=source,
        title=" ".join([command, *args]),
        paused=paused,
        break_on_alarm=break_on_alarm,
        top_k=top_k,
        theme_name=theme,
        trace_path=trace_path,
    )
    if listen:
        app.notify(
            f"listening on {source.server.address}: on the other machines run kvtui watch --connect "
            f"{source.server.address} --token {source.server.token} -- COMMAND",
            timeout=30,
        )
    app.run()
    return app.return_code or 0


def run_tree_headless(
    executable: str,
    command: str,
    args: list[str],
    trace_path,
    fail_on: str,
    top_k: int,
    listen: str | None = None,
    connect: str | None = None,
    token: str | None = None,
    attention: bool = False,
) -> int:
    """Run COMMAND with every Python process of its tree watched; its output passes through. Exit code: the
    command's own, or 1 when an alarm at/above fail_on fired in any process. `listen`: also take the
    processes of other machines (`kvtui watch --connect ADDRESS --token T -- COMMAND` there); `connect`:
    this machine's processes report to a viewer elsewhere, and this one only runs the command."""
    from ..engine.watch import tree

    err = sys.stderr
    server = None
    if connect is None:
        host, _, port = (listen or "127.0.0.1:0").rpartition(":")
        try:
            server = tree.TreeServer(host, int(port))
        except (OSError, ValueError) as error:
            click.echo(f"kvtui watch: cannot listen on {listen}: {getattr(error, 'strerror', None) or error}", file=err)
            return 2
        connect, token = server.address, server.token
        if listen:
            click.echo(
                f"kvtui watch: listening on {server.address} · on the other machines run: kvtui watch "
                f"--connect {server.address} --token {server.token} -- COMMAND",
                file=err,
            )
    try:
        with tree.hook_directory() as hook_dir:
            env = tree.environment(Path(hook_dir), connect, token, top_k, attention=attention)
            code = _run_command(executable, command, args, env, err)
        if server is None or code is None:
            return 2 if code is None else code
        server.wait(timeout=30.0 if listen else 5.0)  # the other machines' ranks end about when this one does
    finally:
        if server is not None:
            server.close()
    return _report(server, command, code, trace_path, fail_on, err)


def _run_command(executable: str, command: str, args: list[str], env: dict, err) -> int | None:
    """The command's exit code (128 + N for a signal, as a shell says), or None when it cannot start.
    Ctrl+c reaches the whole foreground group: the command decides how it ends, kvtui reports after it;
    SIGTERM and SIGHUP to kvtui are passed on to the command."""
    try:
        child = subprocess.Popen([executable, *args], env=env)
    except OSError as error:
        click.echo(f"kvtui watch: {command}: cannot run: {error.strerror or error}", file=err)
        return None
    previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN)}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        previous[sig] = signal.signal(sig, lambda number, _: child.send_signal(number))
    try:
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - code if code < 0 else code


def _models_of(run) -> list[str]:
    """The models a process watched: its goodbye names them; one ended by a signal (a server stopped with SIGTERM)
    said none, and its `model` records do."""
    if run.models:
        return run.models
    return [f"{r.get('name')} ({r.get('class')})" for r in run.records if r.get("type") == "model"]


def _report(server, command: str, code: int, trace_path, fail_on: str, err) -> int:
    from ..engine.records.codec import from_record
    from ..engine.records.recorder import failing
    from ..engine.records.snapshot import Diagnostic
    from ..engine.watch import tree
    from ..fmt import printable
    from ..headless import alarm_summary, request_summary, requests_of

    runs = server.sorted_runs()
    run_alarms = tree.desync(runs)
    if trace_path is not None:
        tree.merge(runs, trace_path, run_alarms)
    for note in server.notes:
        click.echo(f"kvtui watch: {printable(note)}", file=err)
    watched = [run for run in runs if run.watched]
    click.echo(
        f"kvtui watch: {len(watched)} process(es) built a causal LM · {sum(r.steps for r in watched)} forwards "
        f"watched · {command} exit code {code}",
        file=err,
    )
    if not watched:
        click.echo(f"kvtui watch: no process of `{command}` built a causal LM (nothing watched)", file=err)
    alarms: list[Diagnostic] = list(run_alarms)
    for run in watched:
        state = "" if run.finished else " · ended without saying goodbye (killed?)"
        heads = next(
            (
                f" · KV heads held per layer: {r['layers'][0]['k_shape'][1]}"
                for r in run.records
                if r["type"] == "step" and r.get("layers") and r["layers"][0].get("k_shape")
            ),
            "",
        )
        click.echo(
            f"  {run.name}: {run.steps} forwards · models: {printable(', '.join(_models_of(run)) or '?')}"
            f"{heads if run.world_size else ''} · {printable(' '.join(run.argv))}{state}",
            file=err,
        )
        found = [from_record(Diagnostic, d) for d in run.diagnostics]
        alarms += found
        for line in alarm_summary(found, label=f"{run.name} "):  # as for a program, each line naming the process
            click.echo(line, file=err)
        for line in request_summary(requests_of(run.records), label=f"  {run.name} "):
            click.echo(printable(line), file=err)
    merged = tree.shards(runs)
    if merged:
        click.echo(f"  tensor-parallel shards, merged: {merged}", file=err)
    for d in run_alarms:
        click.echo(f"{d.severity:>7} all ranks step {d.step:>4}  {d.code}  {printable(d.message)}", file=err)
    if trace_path is not None:
        click.echo(f"trace written to {trace_path}", file=err)
    failed = failing(alarms, fail_on)
    if failed:
        click.echo(f"{len(failed)} alarm(s) at or above {fail_on}", file=err)
        return 1
    return code
