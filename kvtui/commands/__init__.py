"""kvtui's commands: one module per command, each exporting its click command object (and its headless runner
beside it), which `kvtui.cli` adds to the `main` group: run_cmd (`kvtui [MODEL]`), replay_cmd, themes_cmd,
tiny_cmd, attach_cmd, compare_cmd, diff_cmd, samples_cmd, serve_cmd, watch_cmd. The two helpers below say bad
input the same way in every command: one line, exit 2.

- `diff_cmd.diff`: `kvtui diff A.jsonl B.jsonl [--tie-tolerance X]` -- the first step where two
  traces diverge (exit 0 agree, 1 diverge, 2 unreadable trace). The comparison itself is
  `kvtui.engine.records.diff.diff_traces` (no UI library).
- `serve_cmd`: `kvtui serve [MODEL] [options]` -- the TUI in a web browser (textual-serve).
"""

from __future__ import annotations

import sys

import click


def bad_input(message: str) -> None:
    """Bad input: one line on stderr, exit 2 (never a traceback)."""
    from ..fmt import printable

    click.echo(f"kvtui: error: {printable(' '.join(message.split()))}", err=True)
    sys.exit(2)


def check_theme(theme: str) -> None:
    """A screen opens: --theme checked first (options.check_theme), a problem said in one line."""
    from ..options import OptionError
    from ..options import check_theme as check

    try:
        check(theme)
    except OptionError as exc:
        bad_input(str(exc))
