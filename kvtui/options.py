"""Every option of `kvtui [MODEL]` with its default, in one torch-free module.

The CLI, the app, `kvtui serve` (which checks what it passes through) and replay import it; nothing here
imports the CLI, the app or torch (the engine is imported lazily, inside the functions that need it).
`AppConfig` is the ready configuration the app takes: options merged over the defaults, validated once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import click

from .engine.chat.configure import STATIC_DEFAULT_CAPACITY  # noqa: F401  (re-exported)
from .locations import DEFAULT_THEME  # noqa: F401  (re-exported: the --theme default)

ARCHES = ("llama", "qwen2", "qwen3", "mistral", "gemma3", "gpt2")  # `kvtui tiny --arch`


class OptionError(ValueError):
    """An option value that cannot be used: one line naming the option."""


def session_options(func):
    """The model, cache and sampler options shared by the TUI and the headless runner (in this order in --help)."""
    return _with_options(func, [*_cache_options(), *_sampler_options(), *_prompt_options(), *_model_options()])


def _with_options(func, options: list):
    """`func` with click's option decorators applied so that --help lists them in the given order."""
    for option in reversed(options):
        func = option(func)
    return func


def _cache_options() -> list:
    """Which cache the session makes, and how large."""
    return [
        click.option(
            "--cache",
            type=click.Choice(["dynamic", "static", "quantized", "offloaded", "none"]),
            default="dynamic",
            show_default=True,
            help="Cache kind: DynamicCache(config=...), StaticCache, QuantizedCache, "
            "DynamicCache(offloading=True), or none (no cache: every step a full forward over the whole "
            "context, use_cache=False).",
        ),
        click.option(
            "--cache-bits",
            type=click.Choice(["2", "4"]),
            default="4",
            show_default=True,
            help="Quantized cache: bits per value.",
        ),
        click.option(
            "--cache-backend",
            type=click.Choice(["quanto", "hqq", "fp8"]),
            default="quanto",
            show_default=True,
            help="Quantized cache backend (quanto: pip install optimum-quanto; hqq: pip install hqq; "
            "fp8: built in, ignores --cache-bits).",
        ),
        click.option(
            "--compile",
            "compile_decode",
            is_flag=True,
            default=False,
            help="Static cache: torch.compile the one-token decode forward (counts recompiles).",
        ),
        click.option(
            "--max-cache-len",
            type=click.IntRange(1),
            default=None,
            help=f"Static cache capacity in tokens (default {STATIC_DEFAULT_CAPACITY} with --cache static).",
        ),
        click.option(
            "--press",
            default=None,
            callback=_check_press,
            metavar="SPEC",
            help="Compress the chat's first prefill with a kvpress press (needs kvpress, which pins transformers<5.3): "
            "knorm:RATIO, snapkv:RATIO, pyramid:RATIO, expected:RATIO, tova:RATIO (RATIO: the fraction evicted) or "
            "streaming:SINKS+WINDOW.",
        ),
    ]


def _check_press(ctx, param, value):
    """--press SPEC parsed once, at the command line: a spec that does not parse is a click error naming the grammar."""
    if value is None:
        return None
    from .engine.chat.press_spec import PressSpecError, parse_press

    try:
        return parse_press(value).text
    except PressSpecError as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from None


def _sampler_options() -> list:
    """How long a reply may be and how its tokens are chosen."""
    return [
        click.option("--max-new-tokens", type=click.IntRange(1), default=256, show_default=True),
        click.option("--temperature", type=click.FloatRange(0), default=0.0, show_default=True, help="0 is greedy."),
        click.option("--top-k", type=click.IntRange(0), default=0, show_default=True, help="0 is off."),
        click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0, show_default=True),
        click.option("--repetition-penalty", type=click.FloatRange(0, min_open=True), default=1.0, show_default=True),
        click.option("--seed", type=int, default=0, show_default=True),
    ]


def _prompt_options() -> list:
    """How the chat becomes tokens (and the pitfalls kvtui reproduces), and what each step reports."""
    return [
        click.option(
            "--mode",
            type=click.Choice(["chat", "completion"]),
            default="chat",
            show_default=True,
            help="chat: the chat template; completion: tokenizer(prompt) on raw text.",
        ),
        click.option("--system", default=None, help="System prompt (chat mode)."),
        click.option(
            "--chat-tokenize",
            type=click.Choice(["template", "text"]),
            default="template",
            show_default=True,
            help="template: the template's own ids; text: tokenizer(rendered text), the double-BOS pitfall.",
        ),
        click.option(
            "--prime-pad",
            type=click.IntRange(0),
            default=0,
            help="Reproduce the mistake of priming the cache with N pad tokens.",
        ),
        click.option(
            "--show-top",
            type=click.IntRange(1, 100),
            default=10,
            show_default=True,
            help="How many top-k tokens each snapshot keeps.",
        ),
        click.option("--watch", multiple=True, help="A token (text or id) to follow in every step's distribution."),
        click.option(
            "--attention",
            is_flag=True,
            help="Capture every layer's attention of the newest token (any attention implementation; "
            "O(heads x cache) per layer per step) and shade the buffer by it.",
        ),
    ]


def _model_options() -> list:
    """Which model, in which dtype, on which device and CPU threads."""
    return [
        click.option(
            "--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto", show_default=True
        ),
        click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda, cuda:N or mps."),
        click.option("--device-map", default=None, help="'auto' spreads a large model over devices (accelerate)."),
        click.option(
            "--threads",
            type=click.IntRange(1),
            default=None,
            help="CPU threads for the model's forward (torch.set_num_threads; default: torch's choice).",
        ),
        click.option(
            "--decode-threads",
            type=click.IntRange(1),
            default=None,
            help="CPU threads for one-token (decode) forwards. Default: the model's threads (--threads, or "
            "torch's choice), in the TUI and headless alike. Give both the same N for bit-identical traces.",
        ),
        click.argument("model", required=False),
    ]


def run_options(func):
    """`kvtui run`'s own options (TUI and headless) on top of the session options."""
    options = [
        click.option("--headless", is_flag=True, help="No TUI: run --script and print a summary."),
        click.option(
            "--script",
            "script_path",
            type=click.Path(dir_okay=False, path_type=Path),
            default=None,
            help="JSON/YAML script ({turns, system, mode, prompt}) or .txt (one user turn per line).",
        ),
        click.option(
            "--trace",
            "trace_path",
            type=click.Path(dir_okay=False, path_type=Path),
            default=None,
            help="Write a JSON Lines trace here.",
        ),
        click.option(
            "--verify-every", type=click.IntRange(0), default=0, help="Verify against a full recompute every N steps."
        ),
        click.option(
            "--fail-on",
            type=click.Choice(["info", "warning", "error"]),
            default="error",
            show_default=True,
            help="Headless exit code is 1 when a diagnostic at or above this fired.",
        ),
        click.option(
            "--verbose",
            "-v",
            is_flag=True,
            help="Headless: print every turn and reply in full (default: one line per turn).",
        ),
        click.option(
            "--theme",
            default=DEFAULT_THEME,
            show_default=True,
            help="TUI theme (`kvtui themes` lists them, with the user themes dir).",
        ),
        click.option(
            "--refresh",
            "refresh_hz",
            type=click.FloatRange(0.5, 60),
            default=None,
            help="TUI: pane repaints per second while the model runs (default: 15 while a core is spare, else 2).",
        ),
        click.option(
            "--export-cache-at",
            type=click.IntRange(1),
            default=None,
            help="Headless: save the cache as safetensors right after forward step N.",
        ),
        click.option(
            "--export-cache",
            "export_path",
            type=click.Path(dir_okay=False, path_type=Path),
            default=None,
            help="Where --export-cache-at writes (default cache-stepN.safetensors).",
        ),
    ]
    return _with_options(session_options(func), options)


def run_command(callback=None) -> click.Command:
    """A `run` command with every option (the CLI gives it its callback; serve parses with a bare one)."""
    return click.command("run")(run_options(callback or (lambda **_: None)))


SESSION_KEYS = (
    "cache",
    "cache_bits",
    "cache_backend",
    "compile_decode",
    "max_cache_len",
    "press",
    "max_new_tokens",
    "temperature",
    "top_k",
    "top_p",
    "repetition_penalty",
    "seed",
    "mode",
    "system",
    "chat_tokenize",
    "prime_pad",
    "show_top",
    "watch",
    "attention",
    "dtype",
    "device",
    "device_map",
    "threads",
    "decode_threads",
)
# The session options' defaults, for callers that build the app without the command line (tests, benchmarks,
# code that makes an AppConfig): what an empty command line parses to. Not the parameters' `default`: since
# click 8.3 a flag's is a truthy sentinel, which turned --attention (O(cache) per step) on.
DEFAULT_OPTIONS = {
    name: value
    for name, value in run_command().make_context("run", [], resilient_parsing=True).params.items()
    if name in SESSION_KEYS
}


@dataclass(frozen=True)
class AppConfig:
    """What the TUI runs: the model, every session option (defaults filled in), theme, script, trace."""

    model: str | None = None
    options: dict = field(default_factory=dict)
    theme: str = DEFAULT_THEME
    script: object | None = None  # a kvtui.engine.chat.script.Script
    trace_path: Path | None = None
    verify_every: int = 0
    refresh_hz: float | None = None  # pane repaints per second while running; None: follow the spare CPU

    def __post_init__(self):
        unknown = set(self.options) - set(DEFAULT_OPTIONS)
        if unknown:
            raise OptionError(f"unknown options {sorted(unknown)}")
        object.__setattr__(self, "options", {**DEFAULT_OPTIONS, **self.options})


def check_theme(theme: str) -> None:
    """The one check of --theme, before any screen opens: every theme file must load (a user's broken file names
    itself) and `theme` must name one; an OptionError (one line) otherwise."""
    from .themes import theme_error

    error = theme_error(theme)
    if error:
        raise OptionError(error)


def build_session_config(options: dict, tokenizer=None):
    """Turn options (any subset: the defaults fill the rest) into a SessionConfig; a --watch token that is
    not one token is an OptionError."""
    from .engine.chat import configure

    try:
        return configure.session_config({**DEFAULT_OPTIONS, **options}, tokenizer)
    except configure.WatchTokenError as exc:
        raise OptionError(str(exc)) from None


def resolve_token(tokenizer, text: str) -> int:
    """A watched token: a number is an id; text must encode to exactly one token (else an OptionError)."""
    from .engine.chat import configure

    try:
        return configure.resolve_token(tokenizer, text)
    except configure.WatchTokenError as exc:
        raise OptionError(str(exc)) from None


def load(model: str | None, options: dict, progress=None):
    """Load the model the options name (dtype, device, device map)."""
    from .engine.chat import configure

    return configure.load(model, {**DEFAULT_OPTIONS, **options}, progress=progress)
