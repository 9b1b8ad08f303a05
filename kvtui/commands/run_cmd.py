"""`kvtui [MODEL]` (the `run` command): the TUI on kvtui's own chat, or with --headless a script run beside it
(`_run_headless`, through kvtui/headless.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from ..options import AppConfig, OptionError, build_session_config, load, run_options
from . import bad_input as _bad_input
from . import check_theme as _check_theme


@click.command("run")
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
    from ..engine.chat.script import ScriptError, load_script

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
    from .. import viewers

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


def _check_features(model, options: dict) -> None:
    """What the installed transformers lacks is refused in one line before any screen: a quantized cache
    backend its QuantizedCache does not know, a hybrid whose state its DynamicCache does not keep."""
    if options.get("press"):
        from ..engine.chat.press_spec import INSTALL, kvpress_installed

        if not kvpress_installed():
            _bad_input(f"--press {options['press']} needs kvpress, which is not installed here: {INSTALL}")
    if options.get("cache") == "quantized":
        from ..engine.reading.introspect import quant_backend_refusal

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
    from ..engine.reading.introspect import hybrid_refusal

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
    from ..engine.chat.loader import ModelLoadError, load_tokenizer
    from ..options import OptionError, resolve_token

    try:
        tokenizer = load_tokenizer(model)
        for word in options["watch"]:
            resolve_token(tokenizer, word)
    except (ModelLoadError, OptionError) as exc:
        _bad_input(str(exc))


def _run_headless(model, script, trace_path, verify_every, fail_on, options, export=None, verbose=False) -> int:
    from rich.console import Console

    from ..engine.chat.configure import prepare_cache_backend
    from ..engine.records.child import openmp_wait

    # this process runs the model: its OpenMP threads wait as the TUI's engine's do (a short spin, then sleep),
    # set before torch loads libgomp; a busy core elsewhere then costs a wait, not a stalled team (b_headless.py)
    os.environ.update(openmp_wait())
    from ..engine.chat.loader import ModelLoadError
    from ..engine.chat.session import ChatSession, SessionError
    from ..engine.reading.export import ExportError
    from ..engine.records.trace import TraceError
    from ..headless import run_script

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
