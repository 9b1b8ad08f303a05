"""`kvtui`: the TUI (default), the headless runner (--headless), and helper commands."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ._version import __version__
from .options import ARCHES, DEFAULT_THEME, AppConfig, OptionError, build_session_config, load, run_options


class DefaultGroup(click.Group):
    """`kvtui [MODEL] [options]` runs the default command unless the first word names another."""

    default_command = "run"

    def parse_args(self, ctx, args):
        if not args or (args[0] not in self.commands and args[0] not in ("--help", "-h", "--version")):
            args = [self.default_command, *args]
        return super().parse_args(ctx, args)


def _print_version(ctx, _param, value):
    if not value or ctx.resilient_parsing:
        return
    from .engine.support import version_line

    click.echo(f"kvtui {__version__}, {version_line()}")
    ctx.exit()


@click.group(cls=DefaultGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_version,
    help="Show kvtui's version and the transformers it runs on (tested or not), then exit.",
)
def main():
    """kvtui: inspect the live KV cache of a transformers causal LM while it chats.

    `kvtui [MODEL]` opens the TUI (MODEL: a local directory or a hub id already in the local cache;
    none = the embedded SmolLM2-135M-Instruct). `kvtui [MODEL] --headless --script FILE` runs a script.
    """
    from .engine.support import warning_line

    warning = warning_line()
    if warning:  # outside the tested range: one line at start, then on as usual
        click.echo(warning, err=True)


@main.command("run")
@run_options
@click.pass_context
def run(
    ctx,
    model,
    headless,
    script_path,
    trace_path,
    verify_every,
    fail_on,
    verbose,
    theme,
    refresh_hz,
    export_cache_at,
    export_path,
    **options,
):
    """Open the TUI, or with --headless run a script."""
    from .engine.chat.script import ScriptError, load_script

    script = None
    if script_path is not None:
        try:
            script = load_script(script_path)
        except ScriptError as exc:
            _bad_input(str(exc))
        params = {p.name: p for p in ctx.command.params}
        # A script's own options apply unless given on the command line; they pass the same checks.
        for key, value in script.options.items():
            if key == "model":
                if not isinstance(value, str):
                    _bad_input(f"{script_path}: option 'model' must be a string")
                model = model or value
                continue
            try:
                value = params[key].type.convert(value, params[key], ctx)
            except click.BadParameter as exc:
                _bad_input(f"{script_path}: option {key!r}: {exc.format_message()}")
            if key == "verify_every":
                if ctx.get_parameter_source("verify_every").name == "DEFAULT":
                    verify_every = value
            elif ctx.get_parameter_source(key).name == "DEFAULT":
                options[key] = value
        options["mode"] = script.mode if ctx.get_parameter_source("mode").name == "DEFAULT" else options["mode"]
        if script.system and not options["system"]:
            options["system"] = script.system
    _check_features(model, options)
    if headless:
        if script is None:
            raise click.UsageError("--headless needs --script FILE")
        export = (
            (export_cache_at, export_path or Path(f"cache-step{export_cache_at}.safetensors"))
            if export_cache_at
            else None
        )
        sys.exit(_run_headless(model, script, trace_path, verify_every, fail_on, options, export, verbose))
    _check_theme(theme)
    _check_watch_words(model, options)
    from . import viewers

    app = viewers.chat(
        AppConfig(
            model=model,
            options=options,
            theme=theme,
            script=script,
            trace_path=trace_path,
            verify_every=verify_every,
            refresh_hz=refresh_hz,
        )
    )
    app.run()
    sys.exit(app.return_code or 0)


def _bad_input(message: str) -> None:
    """Bad input: one line on stderr, exit 2 (never a traceback)."""
    from .fmt import printable

    click.echo(f"kvtui: error: {printable(' '.join(message.split()))}", err=True)
    sys.exit(2)


def _check_features(model, options: dict) -> None:
    """What the installed transformers lacks is refused in one line before any screen: a quantized cache
    backend its QuantizedCache does not know, a hybrid whose state its DynamicCache does not keep."""
    if options.get("cache") == "quantized":
        from .engine.reading.introspect import quant_backend_refusal

        refusal = quant_backend_refusal(options.get("cache_backend") or "quanto")
        if refusal:
            _bad_input(refusal)
    if model is None or not _declares_state(Path(str(model)) / "config.json"):  # no transformers import else
        return
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(model), local_files_only=True)
    except Exception:  # noqa: BLE001 - not a config we can read here: the loader says why, in its own line
        return
    from .engine.reading.introspect import hybrid_refusal

    refusal = hybrid_refusal(config)
    if refusal:
        _bad_input(refusal)


def _declares_state(config_file: Path) -> bool:
    """Read the config's JSON (no transformers import on the way to the screen): might it be a hybrid?"""
    import json

    try:
        data = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return False
    text = {**data, **(data.get("text_config") or {})} if isinstance(data, dict) else {}
    markers = ("mamba", "ssm", "state_size", "linear_conv", "linear_key", "conv_L_cache")
    types = text.get("layer_types")
    if isinstance(types, list) and types:
        return any(t not in ("full_attention", "sliding_attention", "chunked_attention") for t in types)
    return any(any(m in key for m in markers) for key in text)


def _check_watch_words(model, options: dict) -> None:
    """--watch words need the tokenizer: load it (not the model) and resolve them before any screen."""
    if not options.get("watch"):
        return
    from .engine.chat.loader import ModelLoadError, load_tokenizer
    from .options import OptionError, resolve_token

    try:
        tokenizer = load_tokenizer(model)
        for word in options["watch"]:
            resolve_token(tokenizer, word)
    except (ModelLoadError, OptionError) as exc:
        _bad_input(str(exc))


def _check_theme(theme: str) -> None:
    """A screen opens: --theme checked first (options.check_theme), a problem said in one line."""
    from .options import check_theme

    try:
        check_theme(theme)
    except OptionError as exc:
        _bad_input(str(exc))


def _run_headless(model, script, trace_path, verify_every, fail_on, options, export=None, verbose=False) -> int:
    from rich.console import Console

    from .engine.chat.configure import prepare_cache_backend
    from .engine.chat.loader import ModelLoadError
    from .engine.chat.session import ChatSession, SessionError
    from .engine.reading.export import ExportError
    from .engine.records.trace import TraceError
    from .headless import run_script

    console = Console(stderr=False)
    try:
        with console.status("loading model…") as status:
            loaded = load(model, options, progress=lambda message, fraction=None: status.update(message))
            session = ChatSession(loaded.model, loaded.tokenizer, build_session_config(options, loaded.tokenizer))
            prepare_cache_backend(session.config, loaded.device, status.update)
        return run_script(
            session,
            script,
            trace_path=trace_path,
            model_source=loaded.source,
            model_path=loaded.path,
            verify_every=verify_every,
            fail_on=fail_on,
            console=console,
            export=export,
            verbose=verbose,
        )
    except (ModelLoadError, SessionError, TraceError, ExportError, OptionError, ValueError) as exc:
        _bad_input(str(exc))  # one line, unwrapped, on stderr


@main.command("replay")
@click.argument("trace_path", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--theme", default="kvtui-dark", show_default=True)
@click.option("--follow", is_flag=True, help="Keep reading: show steps as another process appends them.")
@click.option(
    "--print",
    "print_only",
    is_flag=True,
    help="A server trace (kvtui attach --trace): print its summary and notes instead of opening the TUI.",
)
def replay(trace_path, theme, follow, print_only):
    """Open the TUI on a recorded trace (no model needed): space/u step, r plays. A server trace (kvtui attach
    --trace) opens the attach screen on the prefix cache its events rebuild."""
    from .engine.records.trace import TraceError
    from .engine.serving.server_trace import is_server_trace

    if is_server_trace(trace_path):
        _replay_server_trace(trace_path, theme, follow, print_only)
        return
    if print_only:
        _bad_input(f"{trace_path}: --print is for server traces (kvtui attach --trace); this is a step trace")
    _check_theme(theme)
    if follow and not trace_path.is_file():
        raise click.BadParameter(f"{trace_path}: no such trace file (yet)", param_hint="TRACE_PATH")
    try:
        from . import viewers

        app = viewers.replay(trace_path, theme_name=theme, follow=follow)
    except TraceError as exc:
        _bad_input(str(exc))
    app.run()


def _replay_server_trace(trace_path: Path, theme: str, follow: bool, print_only: bool) -> None:
    from .engine.serving.prefix_cache import summary_lines
    from .engine.serving.server_trace import ServerTraceError, load_server_trace

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
    from . import viewers

    viewers.server(run=run, theme_name=theme).run()


@main.command("themes")
def themes():
    """List the themes: the shipped ones and yours (*.toml in the user themes dir)."""
    from .locations import user_themes_dir

    _check_theme(DEFAULT_THEME)
    from .themes import theme_files

    for path in theme_files():
        click.echo(f"{Path(path.name).stem:24} {path}")
    click.echo(f"\nyour themes: {user_themes_dir()}/*.toml (Textual Theme fields; same name replaces a shipped one)")


@main.command("tiny")
@click.option("--arch", type=click.Choice(ARCHES), required=True)
@click.option("--bos/--no-bos", default=None, help="Post-processor adds BOS (default: the architecture's habit).")
@click.option("--eos/--no-eos", default=False, show_default=True, help="Post-processor appends EOS (the 862→863 bug).")
@click.option("--sliding-window", type=click.IntRange(2), default=None, help="Window for mistral / gemma3.")
@click.option("--layers", type=click.IntRange(1), default=None)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True)
def tiny(arch, bos, eos, sliding_window, layers, seed, out):
    """Build a tiny random model with a real tokenizer and chat template, offline."""
    from .engine.models.tiny import build_tiny

    try:
        path = build_tiny(arch, out, bos=bos, eos=eos, sliding_window=sliding_window, layers=layers, seed=seed)
    except ValueError as exc:
        _bad_input(str(exc))
    click.echo(f"built a tiny {arch} model in {path}")


from .commands.attach_cmd import attach  # noqa: E402
from .commands.compare_cmd import compare  # noqa: E402  (commands live in their own modules)
from .commands.diff_cmd import diff  # noqa: E402
from .commands.samples_cmd import samples  # noqa: E402
from .commands.serve_cmd import serve  # noqa: E402
from .commands.watch_cmd import watch  # noqa: E402

main.add_command(attach)
main.add_command(compare)
main.add_command(diff)
main.add_command(samples)
main.add_command(serve)
main.add_command(watch)

if __name__ == "__main__":
    main()
