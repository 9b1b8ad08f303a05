"""`kvtui`: the TUI (default), the headless runner (--headless), and helper commands."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from . import __version__

THEMES_DIR = Path(__file__).resolve().parent.parent / "themes"


class DefaultGroup(click.Group):
    """`kvtui [MODEL] [options]` runs the default command unless the first word names another."""

    default_command = "run"

    def parse_args(self, ctx, args):
        if not args or (args[0] not in self.commands and args[0] not in ("--help", "-h", "--version")):
            args = [self.default_command, *args]
        return super().parse_args(ctx, args)


def session_options(func):
    """The model, cache and sampler options shared by the TUI and the headless runner."""
    options = [
        click.option("--cache", type=click.Choice(["dynamic", "static", "quantized", "offloaded"]), default="dynamic",
                     show_default=True, help="Cache kind: DynamicCache(config=...), StaticCache, QuantizedCache, "
                     "or DynamicCache(offloading=True)."),
        click.option("--cache-bits", type=click.Choice(["2", "4"]), default="4", show_default=True,
                     help="Quantized cache: bits per value."),
        click.option("--cache-backend", type=click.Choice(["quanto", "hqq", "fp8"]), default="quanto", show_default=True,
                     help="Quantized cache backend (quanto: pip install optimum-quanto; hqq: pip install hqq; "
                     "fp8: built in, ignores --cache-bits)."),
        click.option("--compile", "compile_decode", is_flag=True, default=False,
                     help="Static cache: torch.compile the one-token decode forward (counts recompiles)."),
        click.option("--max-cache-len", type=click.IntRange(1), default=None,
                     help="Static cache capacity in tokens (default 2048 with --cache static)."),
        click.option("--max-new-tokens", type=click.IntRange(1), default=256, show_default=True),
        click.option("--temperature", type=click.FloatRange(0), default=0.0, show_default=True, help="0 is greedy."),
        click.option("--top-k", type=click.IntRange(0), default=0, show_default=True, help="0 is off."),
        click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0, show_default=True),
        click.option("--repetition-penalty", type=click.FloatRange(0, min_open=True), default=1.0, show_default=True),
        click.option("--seed", type=int, default=0, show_default=True),
        click.option("--mode", type=click.Choice(["chat", "completion"]), default="chat", show_default=True,
                     help="chat: the chat template; completion: tokenizer(prompt) on raw text."),
        click.option("--system", default=None, help="System prompt (chat mode)."),
        click.option("--chat-tokenize", type=click.Choice(["template", "text"]), default="template", show_default=True,
                     help="template: the template's own ids; text: tokenizer(rendered text), the double-BOS pitfall."),
        click.option("--prime-pad", type=click.IntRange(0), default=0,
                     help="Reproduce the mistake of priming the cache with N pad tokens."),
        click.option("--show-top", type=click.IntRange(1, 100), default=10, show_default=True,
                     help="How many top-k tokens each snapshot keeps."),
        click.option("--watch", multiple=True, help="A token (text or id) to follow in every step's distribution."),
        click.option("--attention", is_flag=True,
                     help="Shade the buffer by the newest token's attention (eager attention; costs O(cache) per step)."),
        click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto",
                     show_default=True),
        click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda, cuda:N or mps."),
        click.option("--device-map", default=None, help="'auto' spreads a large model over devices (accelerate)."),
        click.argument("model", required=False),
    ]
    for option in reversed(options):
        func = option(func)
    return func


@click.group(cls=DefaultGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvtui")
def main():
    """kvtui: inspect the live KV cache of a transformers causal LM while it chats.

    `kvtui [MODEL]` opens the TUI (MODEL: a local directory or a hub id already in the local cache;
    none = the embedded SmolLM2-135M-Instruct). `kvtui [MODEL] --headless --script FILE` runs a script.
    """


@main.command("run")
@session_options
@click.option("--headless", is_flag=True, help="No TUI: run --script and print a summary.")
@click.option("--script", "script_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="JSON/YAML script ({turns, system, mode, prompt}) or .txt (one user turn per line).")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write a JSON Lines trace here.")
@click.option("--verify-every", type=click.IntRange(0), default=0, help="Verify against a full recompute every N steps.")
@click.option("--fail-on", type=click.Choice(["info", "warning", "error"]), default="error", show_default=True,
              help="Headless exit code is 1 when a diagnostic at or above this fired.")
@click.option("--theme", default="kvtui-dark", show_default=True, help="TUI theme (see themes/).")
@click.option("--export-cache-at", type=click.IntRange(1), default=None,
              help="Headless: save the cache as safetensors right after forward step N.")
@click.option("--export-cache", "export_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Where --export-cache-at writes (default cache-stepN.safetensors).")
@click.pass_context
def run(ctx, model, headless, script_path, trace_path, verify_every, fail_on, theme, export_cache_at, export_path,
        **options):
    """Open the TUI, or with --headless run a script."""
    from .engine.script import ScriptError, load_script

    script = None
    if script_path is not None:
        try:
            script = load_script(script_path)
        except ScriptError as exc:
            raise click.ClickException(str(exc)) from None
        # A script's own options apply unless given on the command line.
        for key, value in script.options.items():
            if key == "model":
                model = model or value
            elif key == "verify_every":
                if ctx.get_parameter_source("verify_every").name == "DEFAULT":
                    verify_every = value
            elif ctx.get_parameter_source(key).name == "DEFAULT":
                options[key] = value
        options["mode"] = script.mode if ctx.get_parameter_source("mode").name == "DEFAULT" else options["mode"]
        if script.system and not options["system"]:
            options["system"] = script.system
    if headless:
        if script is None:
            raise click.UsageError("--headless needs --script FILE")
        export = (export_cache_at, export_path or Path(f"cache-step{export_cache_at}.safetensors")) if export_cache_at else None
        sys.exit(_run_headless(model, script, trace_path, verify_every, fail_on, options, export))
    from .app import KvtuiApp

    app = KvtuiApp(model=model, options=options, theme_name=theme, script=script, trace_path=trace_path,
                   verify_every=verify_every)
    app.run()
    sys.exit(app.return_code or 0)


# The session options' defaults, for callers that build the app without the command line (tests, serve).
DEFAULT_OPTIONS = {p.name: p.default for p in run.params if p.name in {
    "cache", "cache_bits", "cache_backend", "compile_decode", "max_cache_len", "max_new_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "seed", "mode",
    "system", "chat_tokenize", "prime_pad", "show_top", "watch", "attention", "dtype", "device", "device_map"}}
DEFAULT_OPTIONS["watch"] = ()


def build_session_config(options: dict, tokenizer=None):
    """Turn CLI options into a SessionConfig (watch tokens are resolved with the tokenizer)."""
    from .engine.sampling import SamplerSettings
    from .engine.session import SessionConfig

    cache = options["cache"]
    max_cache_len = options.get("max_cache_len") or (2048 if cache == "static" else None)
    sampler = SamplerSettings(temperature=options["temperature"], top_k=options["top_k"], top_p=options["top_p"],
                              repetition_penalty=options["repetition_penalty"], seed=options["seed"])
    watch = tuple(resolve_token(tokenizer, w) for w in options.get("watch") or ()) if tokenizer else ()
    return SessionConfig(cache=cache, max_cache_len=max_cache_len, max_new_tokens=options["max_new_tokens"],
                         cache_bits=int(options.get("cache_bits") or 4), cache_backend=options.get("cache_backend") or "quanto",
                         compile=bool(options.get("compile_decode")),
                         sampler=sampler, mode=options["mode"], system=options.get("system"),
                         chat_tokenize=options["chat_tokenize"], top_k_shown=options["show_top"], watch=watch,
                         prime_pad=options["prime_pad"], attention=bool(options.get("attention")))


def resolve_token(tokenizer, text: str) -> int:
    """A watched token: a number is an id; text must encode to exactly one token."""
    if str(text).isdigit():
        return int(text)
    ids = tokenizer(str(text), add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise click.BadParameter(f"{text!r} is {len(ids)} tokens {ids}; watch one token (or give its id)",
                                 param_hint="--watch")
    return ids[0]


def load(model, options, progress=None):
    from .engine.loader import load_model

    return load_model(model, dtype=options["dtype"], device=options["device"], device_map=options["device_map"],
                      attn_implementation="eager" if options.get("attention") else None, progress=progress)


def _run_headless(model, script, trace_path, verify_every, fail_on, options, export=None) -> int:
    from rich.console import Console

    from .engine.export import ExportError
    from .engine.loader import ModelLoadError
    from .engine.session import ChatSession, SessionError
    from .engine.trace import TraceError
    from .headless import run_script

    console = Console(stderr=False)
    try:
        with console.status("loading model…") as status:
            loaded = load(model, options, progress=lambda message, fraction=None: status.update(message))
        session = ChatSession(loaded.model, loaded.tokenizer, build_session_config(options, loaded.tokenizer))
        return run_script(session, script, trace_path=trace_path, model_source=loaded.source, model_path=loaded.path,
                          verify_every=verify_every, fail_on=fail_on, console=console, export=export)
    except (ModelLoadError, SessionError, TraceError, ExportError, ValueError) as exc:
        click.echo(f"kvtui: error: {exc}", err=True)  # one line, unwrapped, on stderr
        return 2


@main.command("replay")
@click.argument("trace_path", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--theme", default="kvtui-dark", show_default=True)
def replay(trace_path, theme):
    """Open the TUI on a recorded trace (no model needed): space/u step, r plays."""
    from .engine.trace import TraceError

    try:
        from .replay_app import ReplayApp

        app = ReplayApp(trace_path, theme_name=theme)
    except TraceError as exc:
        raise click.ClickException(str(exc)) from None
    app.run()


@main.command("tiny")
@click.option("--arch", type=click.Choice(["llama", "qwen2", "qwen3", "mistral", "gemma3", "gpt2"]), required=True)
@click.option("--bos/--no-bos", default=None, help="Post-processor adds BOS (default: the architecture's habit).")
@click.option("--eos/--no-eos", default=False, show_default=True, help="Post-processor appends EOS (the 862→863 bug).")
@click.option("--sliding-window", type=click.IntRange(2), default=None, help="Window for mistral / gemma3.")
@click.option("--layers", type=click.IntRange(1), default=None)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True)
def tiny(arch, bos, eos, sliding_window, layers, seed, out):
    """Build a tiny random model with a real tokenizer and chat template, offline."""
    from .tiny import build_tiny

    try:
        path = build_tiny(arch, out, bos=bos, eos=eos, sliding_window=sliding_window, layers=layers, seed=seed)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"built a tiny {arch} model in {path}")


from .commands.diff_cmd import diff  # noqa: E402  (commands live in their own modules)
from .commands.serve_cmd import serve  # noqa: E402

main.add_command(diff)
main.add_command(serve)

if __name__ == "__main__":
    main()
