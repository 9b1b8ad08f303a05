"""`kvtui`: the command group. `kvtui [MODEL]` runs the default command (`run`: the TUI, or --headless a script);
every command lives in kvtui/commands/, one module each with its headless runner beside it."""

from __future__ import annotations

import click

from ._version import __version__


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


from .commands.attach_cmd import attach  # noqa: E402  (commands live in their own modules)
from .commands.compare_cmd import compare  # noqa: E402
from .commands.diff_cmd import diff  # noqa: E402
from .commands.replay_cmd import replay  # noqa: E402
from .commands.run_cmd import run  # noqa: E402
from .commands.samples_cmd import samples  # noqa: E402
from .commands.serve_cmd import serve  # noqa: E402
from .commands.themes_cmd import themes  # noqa: E402
from .commands.tiny_cmd import tiny  # noqa: E402
from .commands.watch_cmd import watch  # noqa: E402

for command in (run, replay, themes, tiny, attach, compare, diff, samples, serve, watch):
    main.add_command(command)

if __name__ == "__main__":
    main()
