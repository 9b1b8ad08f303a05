"""`kvtui serve [MODEL] [options]`: the same TUI in a web browser, through textual-serve.

textual-serve runs one `kvtui run [MODEL] [options]` process per browser session and relays it
to xterm.js in the page. Every option that is not serve's own (--host, --port, --title,
--public-url) is passed through unchanged to that command line.
"""

from __future__ import annotations

import shlex
import sys

import click

from ..options import run_command

# Options that make no sense in a served session.
_REFUSED = {"--headless": "--headless has no screen to serve; run it without `serve`"}


def app_command(argv: list[str] | tuple[str, ...]) -> str:
    """The shell command textual-serve runs for each browser session: `kvtui run ARGV...`.

    `run` is named explicitly so a MODEL that happens to be called like a subcommand
    ("tiny", "serve") still means the model.
    """
    return shlex.join([sys.executable, "-m", "kvtui.cli", "run", *argv])


def _check_pass_through(argv: list[str]) -> str | None:
    """Fail now, in the terminal, on options the TUI would reject in every browser session.

    Returns the MODEL the TUI will see (None: the embedded default).
    """
    for arg in argv:
        name = arg.split("=", 1)[0]
        if name in _REFUSED:
            raise click.UsageError(_REFUSED[name])
    try:
        with run_command().make_context("kvtui", list(argv)) as run_ctx:
            return run_ctx.params.get("model")
    except click.ClickException as exc:
        raise click.UsageError(f"in the options passed to the TUI: {exc.format_message()}") from None


@click.command(
    "serve",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": ["-h", "--help"]},
)
@click.argument("model", required=False)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True, help="Port to listen on.")
@click.option("--title", default=None, help="Title on the page's start dialog (default: kvtui and the model).")
@click.option(
    "--public-url", default=None, help="URL browsers use to reach this server (behind a proxy, or with --host 0.0.0.0)."
)
@click.pass_context
def serve(
    ctx: click.Context, model: str | None, host: str, port: int, title: str | None, public_url: str | None
) -> None:
    """Serve the TUI in a web browser (one kvtui process per browser tab).

    Every other option is passed to the TUI, e.g.
    `kvtui serve path/to/model --port 8080 --cache static --theme kvtui-light`.
    """
    # With unknown options allowed, click may put an option of the TUI's in MODEL (`serve --cache static`
    # gives model="--cache"); click keeps the order, so MODEL + the extra args is the command line as
    # typed, and the TUI's own parser says which word is the model.
    argv = ([model] if model is not None else []) + list(ctx.args)
    model = _check_pass_through(argv)
    try:
        from textual_serve.server import Server
    except ImportError:  # pragma: no cover - a dependency of kvtui
        raise click.ClickException("`kvtui serve` needs the textual-serve package: pip install textual-serve") from None

    command = app_command(argv)
    if public_url is None:
        # textual-serve builds the page's websocket URL from this, so it must be an address a browser can
        # use: the wildcard addresses become loopback (pass --public-url for other machines).
        shown_host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
        if ":" in shown_host and not shown_host.startswith("["):
            shown_host = f"[{shown_host}]"  # IPv6 literal
        public_url = f"http://{shown_host}:{port}"
    public_url = public_url.rstrip("/")
    server = Server(command, host=host, port=port, title=title or f"kvtui {model or ''}".strip(), public_url=public_url)
    click.echo(f"kvtui: serving on {public_url}  (Ctrl+C to stop)")
    sys.stdout.flush()
    server.serve()


if __name__ == "__main__":
    serve()
