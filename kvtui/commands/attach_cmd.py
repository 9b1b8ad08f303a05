"""`kvtui attach URL...`: a vLLM/SGLang server's prefix cache, live, from its KV cache events (TUI, or
`--headless`: one line per note, a summary at the end). Read-only: the server answers as unattached."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

import click


@click.command("attach")
@click.argument("urls", nargs=-1)
@click.option(
    "--events", default=None, help="Subscribe to this publisher (tcp://HOST:PORT) instead of asking the server."
)
@click.option("--replay-events", "replay", default=None, help="With --events: the publisher's replay socket.")
@click.option(
    "--dp-ranks",
    type=click.IntRange(1),
    default=1,
    show_default=True,
    help="With --events: data-parallel ranks, rank r publishing on PORT + r.",
)
@click.option("--topic", default="", help="With --events: the topic the server publishes on (vLLM: its config's).")
@click.option(
    "--tokenizer",
    default=None,
    help="Token texts from this local tokenizer (default: the served "
    "model's files where they are on this machine, else the server's /detokenize).",
)
@click.option("--headless", is_flag=True, help="No TUI: print each note as it comes, and a summary at the end.")
@click.option(
    "--trace",
    "trace_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the server trace here (kvtui replay / kvtui diff read it).",
)
@click.option(
    "--duration",
    type=click.FloatRange(0, min_open=True),
    default=None,
    help="Stop after this many seconds (default: until q, Ctrl-C or SIGTERM).",
)
@click.option(
    "--max-blocks",
    type=click.IntRange(1),
    default=200_000,
    show_default=True,
    help="Blocks kept in view; past it the oldest are let go (and counted).",
)
@click.option("--theme", default="kvtui-dark", show_default=True)
def attach(urls, events, replay, dp_ranks, topic, tokenizer, headless, trace_path, duration, max_blocks, theme):
    """Show a vLLM or SGLang server's prefix cache (start the server with --enable-prefix-caching and
    --kv-events-config; README "Attach to a server")."""
    from ..engine.server.attach import AttachOptions, AttachSession, connect
    from ..engine.server.server_http import ServerError

    if (replay or dp_ranks > 1 or topic) and not events:
        raise click.BadParameter("--replay-events, --dp-ranks and --topic go with --events", param_hint="--events")
    for name, endpoint in (("--events", events), ("--replay-events", replay)):
        problem = _endpoint_problem(endpoint)
        if problem is not None:  # else the subscriber waits on it for ever, saying nothing
            said = f"kvtui: error: {name} {endpoint!r} is not a ZeroMQ endpoint ({problem}): give tcp://HOST:PORT"
            click.echo(said, err=True)
            sys.exit(2)
    options = AttachOptions(
        urls=list(urls),
        events=events,
        replay=replay,
        dp_ranks=dp_ranks,
        topic=topic,
        tokenizer=tokenizer,
        trace=trace_path,
        max_blocks=max_blocks,
    )
    if not headless:  # options are checked before anything starts (the session opens the trace file)
        from . import check_theme

        check_theme(theme)
    try:
        servers = connect(options)
    except ServerError as error:
        click.echo(f"kvtui: error: {error}", err=True)
        sys.exit(2)
    if headless:
        sys.exit(run_attach_headless(AttachSession(options, servers), duration))
    from .. import viewers
    from ..engine.server.reader_process import ReaderProcess

    # the reader in a process of its own: the screen's repaints never take its interpreter (in one process a
    # saturated reader yielded to them); it writes the same trace as --headless
    session = ReaderProcess(options, servers)
    session.start(duration)
    try:
        viewers.server(session=session, theme_name=theme).run()  # quit stops the session (never the server)
    finally:
        session.stop()  # also after a crash of the screen: at once when quit stopped it


def _endpoint_problem(endpoint: str | None) -> str | None:
    """What ZeroMQ says of `endpoint` (a throwaway socket's connect: it checks the form, reaches nothing), or None."""
    if endpoint is None:
        return None
    import zmq

    context = zmq.Context()
    socket = context.socket(zmq.SUB)
    try:
        socket.connect(endpoint)
    except zmq.ZMQError as error:
        return str(error.strerror).split(" (addr=")[0]  # the address is said beside it
    finally:
        socket.close(linger=0)
        context.term()
    return None


def run_attach_headless(session, duration: float | None) -> int:
    from ..engine.server.report import summary_lines

    done = threading.Event()

    def stop(_signum, _frame):
        done.set()

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    session.on_note.append(lambda note: click.echo(f"kvtui: {note.severity} {note.code}: {note.message}"))
    session.on_problem.append(lambda problem: click.echo(f"kvtui: {problem.message}", err=True))
    endpoints = ", ".join(e.endpoint for e in session.endpoints)
    try:
        session.start(duration)  # returns once caught up: what the servers do from the line below on is seen live
        click.echo(
            f"kvtui: attached to {session.title}: KV events from {endpoints}; token texts from "
            f"{session.text_source.where}",
            err=True,
        )
        while not done.is_set() and session.running:
            done.wait(0.2)
    finally:
        session.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    with session.cache.lock:
        for line in summary_lines(session.cache):
            click.echo(f"kvtui: {line}")
    return 1 if session.error is not None else 0
